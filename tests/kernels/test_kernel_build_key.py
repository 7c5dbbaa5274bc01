"""Each checkout of the CPU extension's sources builds in a folder of its own. torch's build
file names the sources by their paths, so two checkouts of the same code sharing one build
folder (a clone beside the working tree, a benchmark's baseline worktree) rebuilt it, about
25 s of an engine's start, each time the other had loaded it last."""

import shutil

import kernels.cpu_extension as cpu_extension


def _copy_of_the_sources(monkeypatch, folder):
    """The module's sources and headers, the same bytes, read from `folder`."""
    shutil.copytree(cpu_extension.SOURCES[0].parent, folder)
    monkeypatch.setattr(cpu_extension, "SOURCES",
                        tuple(folder / s.name for s in cpu_extension.SOURCES))
    monkeypatch.setattr(cpu_extension, "HEADERS",
                        tuple(folder / h.name for h in cpu_extension.HEADERS))


def test_the_same_sources_in_another_folder_build_elsewhere(tmp_path, monkeypatch):
    here = cpu_extension.build_directory()
    assert cpu_extension.build_directory() == here  # the key is stable
    _copy_of_the_sources(monkeypatch, tmp_path / "csrc")
    elsewhere = cpu_extension.build_directory()
    assert elsewhere != here and elsewhere.parent == here.parent
    assert cpu_extension.build_directory() == elsewhere


def test_changed_sources_build_elsewhere(tmp_path, monkeypatch):
    _copy_of_the_sources(monkeypatch, tmp_path / "csrc")
    before = cpu_extension.build_directory()
    source = cpu_extension.SOURCES[0]
    source.write_bytes(source.read_bytes() + b"\n// changed\n")
    assert cpu_extension.build_directory() != before
