"""Engine selection: probe order, fallbacks, forced modes, the one log line."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.io.cufile import CuFileHandle, PosixCuFiles
from kvstore.io.device import CpuDeviceOps, DeviceOps
from kvstore.io.fileio import FileIO
from kvstore.io.gds import GdsEngine
from kvstore.io.host import HostEngine
from kvstore.io.pinned import PinnedEngine
from kvstore.io.select import Found, Probes, Selection, probe_cufile, select_engine
from kvstore.io.staging import DeviceStaging, HostStaging, PinnedStaging
from kvstore.io.types import DirectIOProbe
from kvstore.store.page_store import KVStore

NO_CUDA = Found(False, "no CUDA (torch.cuda.is_available() is False)")


class Calls:
    """Which probes ran, in order."""

    def __init__(self) -> None:
        self.order: list[str] = []


def probes(
    calls: Calls,
    *,
    cuda: bool = True,
    kvikio: bool = True,
    cufile: bool = True,
    direct: bool = True,
    compat: str = "off",
) -> Probes:
    def cuda_probe() -> Found:
        calls.order.append("cuda")
        return Found(True, "CUDA device Fake H200") if cuda else NO_CUDA

    def kvikio_probe() -> PosixCuFiles | Found:
        calls.order.append("kvikio")
        if not kvikio:
            return Found(False, "kvikio not importable (No module named 'kvikio')")
        return PosixCuFiles(compat_mode=compat)

    def cufile_probe(root: Path, files: object, ops: DeviceOps, dev: torch.device) -> Found:
        calls.order.append("cufile")
        if not cufile:
            return Found(False, f"cuFile probe failed in {root}: fake failure")
        return Found(True, f"cuFile probe passed in {root}, kvikio compat mode {compat}")

    def direct_probe(root: Path, mode: str, fio: FileIO) -> DirectIOProbe:
        calls.order.append("direct")
        if mode == "off":
            return DirectIOProbe(False, "direct_io=off")
        return (
            DirectIOProbe(True, "O_DIRECT probe passed")
            if direct
            else DirectIOProbe(False, "O_DIRECT probe failed: EINVAL")
        )

    return Probes(
        cuda=cuda_probe,
        kvikio=kvikio_probe,
        cufile=cufile_probe,
        direct=direct_probe,
        device_ops=CpuDeviceOps,
        device=lambda: torch.device("cpu"),
    )


def select(
    tmp_path: Path, calls: Calls, caplog: pytest.LogCaptureFixture, **kw: object
) -> tuple[Selection, list[str]]:
    flags = {
        k: kw.pop(k) for k in list(kw) if k in {"cuda", "kvikio", "cufile", "direct", "compat"}
    }
    config = StoreConfig(root=tmp_path).replace(**kw)
    with caplog.at_level(logging.DEBUG, logger="kvstore"):
        selection = select_engine(config, probes=probes(calls, **flags))  # type: ignore[arg-type]
    selection.engine.close()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kvstore")]
    return selection, lines


def test_auto_with_everything_picks_gds_and_says_why_not_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls = Calls()
    selection, lines = select(tmp_path, calls, caplog)
    assert isinstance(selection.engine, GdsEngine)
    assert isinstance(selection.staging, DeviceStaging)
    assert selection.checksum == "wsum64"
    assert calls.order == ["cuda", "kvikio", "cufile", "direct"]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("kvstore: gds engine (cuFile probe passed in ")
    assert "kvikio compat mode off" in line
    assert "not pinned: gds is usable and avoids the host copy" in line
    assert "not host: device pages need staging (CUDA present)" in line
    assert "checksum wsum64" in line


def test_auto_without_cuda_is_host_and_probes_nothing_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls = Calls()
    selection, lines = select(tmp_path, calls, caplog, cuda=False, direct=False)
    assert type(selection.engine) is HostEngine
    assert isinstance(selection.staging, HostStaging)
    assert selection.checksum == "xxh3_64"
    assert calls.order == ["cuda", "direct"]
    assert selection.engine.direct == DirectIOProbe(False, "O_DIRECT probe failed: EINVAL")
    assert lines == [
        "kvstore: host engine (no CUDA (torch.cuda.is_available() is False)); "
        "not gds: no CUDA (torch.cuda.is_available() is False); "
        "not pinned: no CUDA (torch.cuda.is_available() is False); "
        "O_DIRECT off (O_DIRECT probe failed: EINVAL); checksum xxh3_64"
    ]


def test_auto_without_kvikio_is_pinned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls = Calls()
    selection, lines = select(tmp_path, calls, caplog, kvikio=False)
    assert isinstance(selection.engine, PinnedEngine)
    assert isinstance(selection.staging, PinnedStaging)
    assert selection.checksum == "xxh3_64"
    assert calls.order == ["cuda", "kvikio", "direct"]
    assert len(lines) == 1
    assert "not gds: kvikio not importable (No module named 'kvikio')" in lines[0]
    assert lines[0].startswith("kvstore: pinned engine (CUDA device Fake H200)")


def test_auto_with_a_failing_cufile_probe_is_pinned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    selection, lines = select(tmp_path, Calls(), caplog, cufile=False)
    assert isinstance(selection.engine, PinnedEngine)
    assert "not gds: cuFile probe failed in" in lines[0]


def test_auto_with_kvikio_in_compat_mode_is_pinned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    selection, lines = select(tmp_path, Calls(), caplog, compat="on")
    assert isinstance(selection.engine, PinnedEngine)
    assert "not gds: kvikio compat mode is on" in lines[0]


def test_auto_with_a_host_checksum_is_pinned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    selection, lines = select(tmp_path, Calls(), caplog, checksum="crc32c")
    assert isinstance(selection.engine, PinnedEngine)
    assert selection.checksum == "crc32c"
    assert "not gds: checksum=crc32c is computed on the host" in lines[0]


def test_forced_gds_in_compat_mode_is_honoured_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    selection, lines = select(tmp_path, Calls(), caplog, io_mode="gds", compat="on")
    assert isinstance(selection.engine, GdsEngine)
    assert "kvikio compat mode on" in selection.engine.describe()
    assert lines[0].startswith("kvstore: gds engine (io_mode=gds, cuFile probe passed")


def test_forced_host_probes_no_device(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls = Calls()
    selection, lines = select(tmp_path, calls, caplog, io_mode="host", direct_io="off")
    assert type(selection.engine) is HostEngine
    assert calls.order == ["direct"]
    assert "not gds: io_mode=host; not pinned: io_mode=host" in lines[0]


def test_forced_pinned_on_a_cuda_machine(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls = Calls()
    selection, _ = select(tmp_path, calls, caplog, io_mode="pinned")
    assert isinstance(selection.engine, PinnedEngine)
    assert calls.order == ["cuda", "direct"]  # no kvikio or cuFile probe for pinned


@pytest.mark.parametrize(
    ("mode", "flags", "expected"),
    [
        ("pinned", {"cuda": False}, "io_mode=pinned: expected a CUDA device, found no CUDA"),
        ("gds", {"cuda": False}, "io_mode=gds: expected a CUDA device, found no CUDA"),
        (
            "gds",
            {"kvikio": False},
            "io_mode=gds: expected kvikio with a working cuFile, found kvikio not importable",
        ),
        (
            "gds",
            {"cufile": False},
            "io_mode=gds: expected kvikio with a working cuFile, found cuFile probe failed",
        ),
    ],
)
def test_forced_modes_that_cannot_work_are_startup_errors(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    flags: dict[str, bool],
    expected: str,
) -> None:
    with pytest.raises(ConfigError) as info:
        select(tmp_path, Calls(), caplog, io_mode=mode, **flags)
    assert str(info.value).startswith(expected)


def test_forced_direct_io_on_still_fails_loudly(tmp_path: Path) -> None:
    class NoDirect(FileIO):
        def open(self, path: str, flags: int, mode: int = 0o600) -> int:
            if flags & getattr(__import__("os"), "O_DIRECT", 0):
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().open(path, flags, mode)

    config = StoreConfig(root=tmp_path, direct_io="on", io_mode="host")
    with pytest.raises(ConfigError, match="direct_io=on"):
        select_engine(config, NoDirect())


def test_read_only_stores_probe_nothing(tmp_path: Path) -> None:
    calls = Calls()
    selection = select_engine(StoreConfig(root=tmp_path), read_only=True, probes=probes(calls))
    assert type(selection.engine) is HostEngine
    assert calls.order == []
    assert selection.line == ""


def test_the_store_uses_the_selection(tmp_path: Path) -> None:
    config = StoreConfig(root=tmp_path / "s", durability="none", io_mode="gds")
    with KVStore(config, probes=probes(Calls())) as store:
        assert isinstance(store.engine, GdsEngine)
        assert store.checksum == "wsum64"
        assert isinstance(store.staging, DeviceStaging)


def test_cufile_probe_writes_reads_and_removes_its_file(tmp_path: Path) -> None:
    files = PosixCuFiles()
    found = probe_cufile(tmp_path, files, CpuDeviceOps(), torch.device("cpu"))
    assert found.ok, found.detail
    assert found.detail == f"cuFile probe passed in {tmp_path}, kvikio compat mode posix"
    assert [op for op, *_ in files.calls] == ["pwrite", "pread"]
    assert list(tmp_path.iterdir()) == []


def test_cufile_probe_failure_is_an_answer_not_a_crash(tmp_path: Path) -> None:
    class Broken(PosixCuFiles):
        def open(self, path: str, flags: str) -> CuFileHandle:
            raise RuntimeError("cuFileHandleRegister failed: filesystem not supported")

    found = probe_cufile(tmp_path, Broken(), CpuDeviceOps(), torch.device("cpu"))
    assert not found.ok
    assert "cuFileHandleRegister failed" in found.detail
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine answer")
def test_real_probes_on_a_cpu_machine_pick_the_host_engine(tmp_path: Path) -> None:
    selection = select_engine(StoreConfig(root=tmp_path, io_mode="auto"))
    selection.engine.close()
    assert type(selection.engine) is HostEngine
    assert selection.line.startswith("kvstore: host engine (no CUDA")


def test_opening_a_store_logs_exactly_one_selection_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = StoreConfig(root=tmp_path / "s", durability="none", io_mode="pinned")
    with caplog.at_level(logging.DEBUG, logger="kvstore"), KVStore(config, probes=probes(Calls())):
        pass
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstore.select"]
    assert len(lines) == 1
    assert lines[0].startswith("kvstore: pinned engine (io_mode=pinned, CUDA device Fake H200)")


def test_a_kvikio_that_fails_to_load_is_an_answer_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvstore.io.cufile as cufile  # noqa: PLC0415
    from kvstore.io.select import _probe_kvikio  # noqa: PLC0415

    def broken() -> None:
        # libkvikio's loader raises cuda.pathfinder's DynamicLibNotFoundError, a RuntimeError
        raise RuntimeError('Failure finding "libcufile.so.0"')

    monkeypatch.setattr(cufile, "KvikioCuFiles", broken)
    found = _probe_kvikio()
    assert isinstance(found, Found) and not found.ok
    assert "libcufile.so.0" in found.detail

    def missing() -> None:
        raise ImportError("No module named 'kvikio'")

    monkeypatch.setattr(cufile, "KvikioCuFiles", missing)
    found = _probe_kvikio()
    assert isinstance(found, Found) and found.detail.startswith("kvikio not importable")


def test_cufile_probe_moves_kvikio_gds_threshold(tmp_path: Path) -> None:
    files = PosixCuFiles(gds_threshold=16384)
    found = probe_cufile(tmp_path, files, CpuDeviceOps(), torch.device("cpu"))
    assert found.ok, found.detail
    assert [(op, off, n) for op, _, off, n in files.calls] == [
        ("pwrite", 0, 16384),
        ("pread", 0, 16384),
    ]
