"""The colocated ``tensor`` transport's shared-memory segments (megarl/sync/transports/tensor.py): each sender
lists the segments it makes; a sender's start unlinks those of senders that are gone (SIGKILLed, as a run's
trainer ranks are), but not one a live process still maps, nor those of a sender still running."""
import mmap
import subprocess
import sys
import uuid

import pytest

from megarl.sync.transports.tensor import MANIFEST_PREFIX, SHARED_MEMORY, remove_orphaned_segments

pytestmark = pytest.mark.skipif(not SHARED_MEMORY.is_dir(), reason="no /dev/shm: the CPU buffers are not files")

# A sender process: two shared buckets; prints its manifest and the segments' names as torch gives them.
SENDER = """
import os, sys
from megarl.sync.transports.tensor import TensorSender
sender = TensorSender()
buffers = [sender.new_buffer(1 << 16) for _ in range(2)]
print(" ".join(open(f"/dev/shm/megarl-tensor-sync-{os.getpid()}").read().split()))
print(" ".join(b.untyped_storage()._share_filename_cpu_()[1].decode().lstrip("/") for b in buffers), flush=True)
sys.stdin.read()
"""


def orphan(pid: int, count: int) -> list[str]:
    """``count`` segments listed in the manifest of ``pid`` (as a sender killed before its cleanup left them)."""
    names = [f"megarl-test-{uuid.uuid4().hex}" for _ in range(count)]
    for name in names:
        (SHARED_MEMORY / name).write_bytes(b"\0" * 8192)
    (SHARED_MEMORY / f"{MANIFEST_PREFIX}{pid}").write_text("".join(n + "\n" for n in names))
    return names


def finished_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.processes
def test_a_sender_lists_the_segments_it_makes():
    proc = subprocess.Popen([sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        listed, made = proc.stdout.readline().split(), proc.stdout.readline().split()
        assert listed == made and len(made) == 2 and all((SHARED_MEMORY / n).exists() for n in made)
        remove_orphaned_segments()
        assert all((SHARED_MEMORY / n).exists() for n in made)  # its sender is alive
    finally:
        proc.communicate("", timeout=60)
    remove_orphaned_segments()  # gone now: what torch did not unlink at its exit goes
    assert not any((SHARED_MEMORY / n).exists() for n in made)
    assert not (SHARED_MEMORY / f"{MANIFEST_PREFIX}{proc.pid}").exists()


@pytest.mark.processes
def test_a_gone_senders_segments_are_unlinked_but_not_one_still_mapped():
    pid = finished_pid()
    names = orphan(pid, 3)
    manifest = SHARED_MEMORY / f"{MANIFEST_PREFIX}{pid}"
    try:
        with open(SHARED_MEMORY / names[0], "r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:  # an engine's view
            remove_orphaned_segments()
            assert (SHARED_MEMORY / names[0]).exists() and manifest.exists()  # kept while mapped
            assert not any((SHARED_MEMORY / n).exists() for n in names[1:])
            mapped[0]
        remove_orphaned_segments()
        assert not (SHARED_MEMORY / names[0]).exists() and not manifest.exists()
    finally:
        for name in names:
            (SHARED_MEMORY / name).unlink(missing_ok=True)
        manifest.unlink(missing_ok=True)


@pytest.mark.processes
def test_a_manifest_another_sender_removed_meanwhile_is_skipped(monkeypatch):
    """The senders of a pipeline's stages start at once and each cleans up: a manifest that one of them
    removes between another's listing and its reading is skipped, and the other orphans still go."""
    import megarl.sync.transports.tensor as tensor

    first, second = finished_pid(), finished_pid()
    taken, left = orphan(first, 1), orphan(second, 2)
    real = tensor.mapped_segments

    def the_other_sender_cleans_up_first():
        for name in taken:
            (SHARED_MEMORY / name).unlink()
        (SHARED_MEMORY / f"{MANIFEST_PREFIX}{first}").unlink()
        return real()

    monkeypatch.setattr(tensor, "mapped_segments", the_other_sender_cleans_up_first)
    try:
        removed = remove_orphaned_segments()
        assert set(left) <= set(removed) and not set(taken) & set(removed)
        assert not (SHARED_MEMORY / f"{MANIFEST_PREFIX}{second}").exists()
    finally:
        for name in taken + left:
            (SHARED_MEMORY / name).unlink(missing_ok=True)
        for pid in (first, second):
            (SHARED_MEMORY / f"{MANIFEST_PREFIX}{pid}").unlink(missing_ok=True)


@pytest.mark.unit
def test_a_running_senders_and_foreign_files_stay():
    names = orphan(1, 1)  # pid 1 is alive
    foreign = SHARED_MEMORY / f"{MANIFEST_PREFIX}not-a-pid"
    foreign.write_text(names[0] + "\n")
    try:
        assert names[0] not in remove_orphaned_segments()
        assert (SHARED_MEMORY / names[0]).exists() and foreign.exists()
    finally:
        (SHARED_MEMORY / names[0]).unlink(missing_ok=True)
        (SHARED_MEMORY / f"{MANIFEST_PREFIX}1").unlink(missing_ok=True)
        foreign.unlink(missing_ok=True)
