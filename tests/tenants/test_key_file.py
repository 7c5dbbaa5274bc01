"""The key file: pagedgen-keys (the real console script) adds keys and prints each once; a
file that is not valid is refused naming the entry, the field and what is allowed."""

from __future__ import annotations

import subprocess

import pytest

from tenancy.keys import hash_key, load_key_file
from trust.cli_args import tls_argv

VALID_HASH = "0" * 64


def test_pagedgen_keys_adds_a_key_and_stores_only_its_hash(tmp_path):
    path = tmp_path / "keys.toml"
    done = subprocess.run(["pagedgen-keys", "add", "--file", str(path), "--tenant", "acme",
                           "--max-pins", "8", "--may-set-priority"],
                          capture_output=True, text=True, timeout=60, check=True)
    key = done.stdout.strip()
    assert key and key not in path.read_text()
    assert hash_key(key) in path.read_text()
    tenant = load_key_file(path).tenant_for(key)
    assert (tenant.name, tenant.max_pins, tenant.may_set_priority) == ("acme", 8, True)
    assert load_key_file(path).tenant_for(key + "x") is None


def test_settings_named_for_a_tenant_that_exists_are_refused_not_ignored(tmp_path):
    """A second key of a tenant takes the tenant's table as it is; a setting named with it
    that differs (an operator granting --may-read-stats) would do nothing, so it is refused,
    the file unchanged, saying where the setting lives. The same settings again (the README's
    set-up run twice) add the key."""
    path = tmp_path / "keys.toml"
    first = subprocess.run(["pagedgen-keys", "add", "--file", str(path), "--tenant", "acme"],
                           capture_output=True, text=True, timeout=60, check=True)
    before = path.read_text()
    refused = subprocess.run(["pagedgen-keys", "add", "--file", str(path), "--tenant", "acme",
                              "--may-read-stats", "--max-pins", "8"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and not refused.stdout
    assert ("tenant 'acme' exists" in refused.stderr and "--max-pins, --may-read-stats"
            in refused.stderr and "[tenants.acme]" in refused.stderr), refused.stderr
    assert path.read_text() == before
    second = subprocess.run(["pagedgen-keys", "add", "--file", str(path), "--tenant", "acme",
                             "--label", "ci", "--max-pins", "0", "--max-live-requests", "256"],
                            capture_output=True, text=True, timeout=60, check=True)
    keys = load_key_file(path)
    for done in (first, second):
        tenant = keys.tenant_for(done.stdout.strip())
        assert (tenant.name, tenant.may_read_stats, tenant.max_pins) == ("acme", False, 0)


def test_a_tenant_table_without_keys_gets_its_key_not_a_second_table(tmp_path):
    """A [tenants.NAME] written by hand (docs/security.md) has no key yet: the tool adds one
    under it (it appended a second table, and the file no longer loaded)."""
    path = tmp_path / "keys.toml"
    path.write_text("[tenants.acme]\nmax_pins = 512\n")
    done = subprocess.run(["pagedgen-keys", "add", "--file", str(path), "--tenant", "acme",
                           "--cache-group", "acme"],  # (its own name: what the table means)
                          capture_output=True, text=True, timeout=60, check=True)
    tenant = load_key_file(path).tenant_for(done.stdout.strip())
    assert (tenant.name, tenant.max_pins) == ("acme", 512)
    assert path.read_text().count("[tenants.acme]") == 1


@pytest.mark.parametrize("flags, message", [
    (["--max-pins", "-5"], "--max-pins must be >= 0, or -1 for no limit, got -5"),
    (["--max-live-requests", "-2"], "--max-live-requests must be >= 0, or -1 for no limit"),
    (["--cache-group", "a b"], "--cache-group must be 1 to 64 characters"),
])
def test_a_bad_setting_is_refused_naming_the_flag_and_nothing_is_written(tmp_path, flags,
                                                                         message):
    path = tmp_path / "keys.toml"
    refused = subprocess.run(["pagedgen-keys", "add", "--file", str(path), "--tenant", "newt",
                              *flags], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert list(tmp_path.iterdir()) == []  # no file, no .partial left behind


@pytest.mark.parametrize("text, message", [
    ("[tenants.a]\nmax_pins = 'many'\n", "tenants.a.max_pins must be an integer >= 0"),
    ("[tenants.a]\ncolour = 1\n", "tenants.a: fields must be among"),
    ("[tenants.a]\n[[keys]]\ntenant = 'b'\nsha256 = '" + VALID_HASH + "'\n",
     "keys[0].tenant must name a [tenants.NAME] table of the file (a), got 'b'"),
    ("[tenants.a]\n[[keys]]\ntenant = 'a'\nsha256 = 'secret'\n",
     "keys[0].sha256 must be the key's SHA-256 as 64 lowercase hex digits"),
    ("[tenants.a]\n[[keys]]\ntenant = 'a'\nsha256 = '" + VALID_HASH + "'\n"
     "[[keys]]\ntenant = 'a'\nsha256 = '" + VALID_HASH + "'\n", "keys[1].sha256 must be unique"),
    ("[tenants.'a b']\n", "a tenant's name must be 1 to 64 characters"),
    ("tenants = 3\n", "tenants must be a table"),
    ("[tenants.a\n", "not valid TOML"),
])
def test_a_bad_key_file_is_refused_naming_the_field(tmp_path, text, message):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as refused:
        load_key_file(path)
    assert message in str(refused.value)
    assert str(path) in str(refused.value)


def test_a_server_refuses_to_start_on_a_bad_key_file(tmp_path, test_certs):
    path = tmp_path / "keys.toml"
    path.write_text("[tenants.a]\nmax_live_requests = -5\n")
    done = subprocess.run(["pagedgen-router", "--engines", "127.0.0.1:1", "--api-key-file",
                           str(path), *tls_argv(test_certs.files("router"))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "tenants.a.max_live_requests must be an integer >= 0 (-1: no limit), got -5" in (
        done.stderr)
