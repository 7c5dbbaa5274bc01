"""deploy/kubernetes/README.md's certificates section says what the services do today: its
pagedgen-certs and kubectl commands, run as written, name files the tool writes; the variables
it sets are the ones the services read; its cert-manager sketch issues the identities trust/
checks (a spiffe://pagedgen/<role> URI and the <role>.pagedgen.internal name the services
dial)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import yaml

from trust.certs import ROLE_DNS_SUFFIX
from trust.cli_args import TLS_ENV
from trust.identity import SPIFFE_PREFIX

README = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "README.md"


def section() -> str:
    text = README.read_text()
    start = text.index("## Certificates and keys")
    return text[start:text.index("\n## ", start + 1)]


def test_the_commands_make_the_files_the_secrets_read(tmp_path):
    [block] = [b for b in re.findall(r"```sh\n(.*?)```", section(), flags=re.S)
               if "pagedgen-certs" in b]
    lines = block.replace("\\\n", " ").splitlines()
    [certs] = [shlex.split(line.strip()) for line in lines if line.strip().startswith(
        "pagedgen-certs")]
    subprocess.run(certs, cwd=tmp_path, check=True, capture_output=True, timeout=120)
    loop = re.search(r"for role in ([\w ]+); do(.*?)done", " ".join(lines), flags=re.S)
    assert loop, block
    for role in loop.group(1).split():
        for source in re.findall(r"--from-file=[\w.]+=(\S+)", loop.group(2)):
            assert (tmp_path / source.replace("$role", role)).is_file(), source


def test_the_variables_are_the_ones_the_services_read():
    text = section()
    for env in TLS_ENV.values():
        assert env in text, f"{env} is not named"
    named = set(re.findall(r"PAGEDGEN_TLS_\w+", text))
    assert named <= set(TLS_ENV.values()), named - set(TLS_ENV.values())


def test_the_cert_manager_sketch_issues_the_identities_trust_checks():
    [sketch] = re.findall(r"```yaml\n(.*?)```", section(), flags=re.S)
    lines = [line.removeprefix("# ").removeprefix("#") for line in sketch.splitlines()]
    certificate = yaml.safe_load("\n".join(lines[:lines.index("")]))
    assert certificate["kind"] == "Certificate"
    assert f"{SPIFFE_PREFIX}router" in certificate["spec"]["uris"]
    assert f"router{ROLE_DNS_SUFFIX}" in certificate["spec"]["dnsNames"]
    assert {"server auth", "client auth"} <= set(certificate["spec"]["usages"])
    csi = yaml.safe_load("\n".join(line for line in lines[lines.index("") + 1:]
                                   if not line.startswith(("Or ", "(files"))))
    attributes = csi["volumes"][0]["csi"]["volumeAttributes"]
    assert attributes["csi.cert-manager.io/uri-sans"] == f"{SPIFFE_PREFIX}engine/${{POD_NAME}}"
    assert attributes["csi.cert-manager.io/dns-names"] == f"engine{ROLE_DNS_SUFFIX}"
