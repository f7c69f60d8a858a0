"""The `kernels` package and Hugging Face's `kernels` distribution share an import name: when both are
installed, asking this package for a name it lacks says so instead of a bare "cannot import name"."""
import importlib.metadata
import sys

import pytest

import kernels


def test_a_missing_name_is_an_attribute_error_without_the_hub_distribution(monkeypatch):
    monkeypatch.setattr(kernels, "_hub_kernels_installed", lambda: False)
    with pytest.raises(AttributeError, match="CUDAProperties"):
        kernels.CUDAProperties


def test_a_missing_name_names_the_clash_when_the_hub_distribution_is_installed(monkeypatch):
    monkeypatch.setattr(kernels, "_hub_kernels_installed", lambda: True)
    with pytest.raises(ImportError, match="Hugging Face's `kernels`.*transformers < 5.25"):
        from kernels import CUDAProperties  # noqa: F401


def test_own_submodules_and_private_names_still_import_with_the_hub_distribution(monkeypatch):
    monkeypatch.setattr(kernels, "_hub_kernels_installed", lambda: True)
    monkeypatch.delitem(sys.modules, "kernels.lora_ref", raising=False)
    monkeypatch.delattr(kernels, "lora_ref", raising=False)
    from kernels import lora_ref
    assert lora_ref.__name__ == "kernels.lora_ref"
    with pytest.raises(AttributeError):
        kernels._no_such_private_name


def test_the_detector_reads_installed_distributions(monkeypatch):
    def fake_distribution(name):
        if name == "kernels":
            return object()
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", fake_distribution)
    assert kernels._hub_kernels_installed()
    monkeypatch.setattr(importlib.metadata, "distribution",
                        lambda name: (_ for _ in ()).throw(importlib.metadata.PackageNotFoundError(name)))
    assert not kernels._hub_kernels_installed()
