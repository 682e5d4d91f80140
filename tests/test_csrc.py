"""Every csrc/*.cu compiles with nvcc for sm_80 and sm_90 (the CI rule for CUDA sources), and the
C extension of the CPU path is built."""

import pathlib
import shutil
import subprocess

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))


def test_there_are_cuda_sources():
    names = {p.name for p in SOURCES}
    assert {"cuda_ipc.cu", "kernels.cu"} <= names, names


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is absent on this machine")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(source, arch, tmp_path):
    # no -I: every source includes its headers by paths relative to itself, so that it compiles
    # as the project's CUDA rule runs it (nvcc -arch=... file.cu), from any directory
    proc = subprocess.run(["nvcc", f"-arch={arch}", "-Werror", "all-warnings", "-c",
                           str(source), "-o", str(tmp_path / "out.o")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.o").stat().st_size > 0


def test_cpu_extension_is_built():
    """pip install -e . builds commlib.transports._shm from csrc/shm/ (setup.py) where gcc and the Python
    headers exist, as on this machine."""
    import commlib.transports._shm as ext

    assert ext.MAX_RANKS == 64 and hasattr(ext, "Segment")
