"""Checkpoints (nanodist.checkpoint): the whole training state round-trips in both formats; full checkpoints load at
any world size and in plain torch; a save killed midway, a truncated or corrupted file and a crafted pickle are all
handled; bad input is refused with a message that says what differs. (Lab 6 under torchrun: test_lab06.py.)"""
import argparse
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nanodist as nd
from nanodist import checkpoint, experiment
from nanodist.checkpoint import (STATE_FORMAT, CheckpointError, CheckpointManager, fingerprint, load, read_meta,
                                 verify)
from nanodist.group import Group
from nanodist.testing import run_script, spawn

TINY = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--no-progress", "--steps", "8",
        "--checkpoint-every", "4"]
LAUNCH_S = 120  # each launch bounds its own wait


# ----------------------------------------------------------------------------- in-process: the state itself

def make_args(*extra):
    p = argparse.ArgumentParser()
    experiment.add_arguments(p)
    args = p.parse_args(["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--no-progress", "--steps",
                         "6", "--shared-memory", "off", *extra])
    return args


def make_run(wrapper="single", optimizer="adamw", group=None, manager=None, every=0):
    args = make_args()
    data = experiment.load_data(args)
    return experiment.build(args, data, Group.resolve(group), wrapper=wrapper, optimizer=optimizer, name="t",
                            checkpoints=manager, checkpoint_every=every)


SETUPS = [("nanodist-pg", "adamw"), ("none", "dist-adamw"), ("none", "dist-muon"),
          ("fsdp", "adamw"), ("fsdp2", "adamw")]
ASYNC_SETUPS = [("none", "dist-adamw"), ("fsdp2", "adamw")]


def round_trip_worker(rank, world, directory):
    """Every set-up, both formats, sync and async: train 3 steps, save, load into a fresh run at step 0; the state
    (fingerprint, step, tokens, schedule, cursor, generators) and the next two losses equal the original's."""
    out = []
    for wrapper, optimizer in SETUPS:
        # every set-up in both formats; the asynchronous save (a snapshot, then the same writer in a thread or
        # dcp.async_save) does not depend on the wrapper: once with plain tensors, once with FSDP2's DTensors
        modes = [("full", False), ("sharded", False)] + ([("sharded", True), ("full", True)]
                                                         if (wrapper, optimizer) in ASYNC_SETUPS else [])
        for fmt, asynchronous in modes:
            d = Path(directory) / f"{wrapper}-{optimizer}-{fmt}-{asynchronous}"
            mgr = CheckpointManager(d, format=fmt, async_save=asynchronous, record_fingerprint=True)
            a = make_run(wrapper, optimizer)
            a.trainer.fit(max_steps=3)
            report = mgr.save(a.trainer)
            mgr.wait()
            saved = fingerprint(a.trainer)
            sd = a.trainer.state_dict()
            b = make_run(wrapper, optimizer)
            assert mgr.resume(b.trainer, "auto") == d / "step_00000003"
            loaded = b.trainer.state_dict()
            restored = fingerprint(b.trainer)
            same = {k: sd[k] == loaded[k] for k in ("step", "tokens_seen", "scheduler", "data", "run_id")}
            rng_same = all(torch.equal(x, y) if torch.is_tensor(x) else x == y
                           for x, y in zip(_flat(sd["rng"]), _flat(loaded["rng"])))
            la = [h["loss"] for h in a.trainer.fit(max_steps=2)[-2:]]
            lb = [h["loss"] for h in b.trainer.fit(max_steps=2)[-2:]]
            out.append({"setup": (wrapper, optimizer, fmt, asynchronous), "fp": (saved, restored),
                        "meta_fp": read_meta(d / "step_00000003")["fingerprint"], "same": same, "rng": rng_same,
                        "losses": (la, lb), "blocked": report.blocked_s, "async": report.asynchronous})
            mgr.close()
    return out


def _flat(tree):
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from _flat(tree[k])
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _flat(v)
    else:
        yield tree


@pytest.mark.dist
def test_every_stateful_piece_round_trips_in_both_formats(tmp_path):
    outs = spawn(round_trip_worker, 2, args=(str(tmp_path),), timeout=120)
    for rank_out in outs:
        assert len(rank_out) == 2 * len(SETUPS) + 2 * len(ASYNC_SETUPS)
        for o in rank_out:
            assert o["fp"][0] == o["fp"][1] == o["meta_fp"], o["setup"]
            assert all(o["same"].values()) and o["rng"], (o["setup"], o["same"])
            assert o["losses"][0] == o["losses"][1], o["setup"]
            assert o["async"] == o["setup"][3]


def reshard_full_worker(rank, world, directory, step):
    """Load the full checkpoints saved at W = 2 at this world size: the state is the saved one."""
    out = {}
    for wrapper, optimizer in (("fsdp", "adamw"), ("none", "dist-muon"), ("fsdp2", "adamw")):
        d = Path(directory) / f"{wrapper}-{optimizer}"
        if step == "save":
            mgr = CheckpointManager(d, format="full", record_fingerprint=True)
            a = make_run(wrapper, optimizer)
            a.trainer.fit(max_steps=2)
            mgr.save(a.trainer)
        else:
            b = make_run(wrapper, optimizer)
            meta = load(d / "step_00000002", b.trainer)
            out[wrapper, optimizer] = (meta["fingerprint"], fingerprint(b.trainer), b.trainer.step)
    return out


@pytest.mark.dist
def test_a_full_checkpoint_loads_at_any_world_size_and_in_plain_torch(tmp_path):
    spawn(reshard_full_worker, 2, args=(str(tmp_path), "save"), timeout=120)
    for world in (3, 1):
        for rank_out in spawn(reshard_full_worker, world, args=(str(tmp_path), "load"), timeout=120):
            for setup, (saved, now, step) in rank_out.items():
                assert saved == now and step == 2, (world, setup)
    # one file that torch alone reads, tensors and plain values only
    script = textwrap.dedent(f"""
        import sys, torch
        sd = torch.load({str(tmp_path / 'fsdp-adamw' / 'step_00000002' / 'state.pt')!r}, weights_only=True)
        assert not any(m.startswith('nanodist') for m in sys.modules)
        print(sorted(sd), sd['step'], sorted(sd['rng']), tuple(sd['model']['wte.weight'].shape))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "'model', 'optimizer', 'rng'" in out.stdout and " 2 ['rank0', 'rank1'] " in out.stdout


def failing_load_worker(rank, world, directory):
    """Rank 1 cannot read the file; every rank must fail, saying so, and none may wait for the others."""
    mgr = CheckpointManager(directory, format="full")
    a = make_run("fsdp", "adamw")
    a.trainer.fit(max_steps=1)
    mgr.save(a.trainer)
    if rank == 1:
        def broken(*args, **kwargs):
            raise OSError("Input/output error (simulated on rank 1)")
        torch.load = broken
    try:
        load(mgr.latest(), make_run("fsdp", "adamw").trainer)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_a_rank_that_cannot_load_makes_every_rank_fail_with_its_reason(tmp_path):
    for msg in spawn(failing_load_worker, 2, args=(str(tmp_path),), timeout=120):
        assert msg is not None and "failed on rank 1" in msg and "simulated on rank 1" in msg and "state.pt" in msg


# ----------------------------------------------------------------------------- one process: files and faults

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at steps 2, 4 and 6 of a one-process run, in both formats."""
    root = tmp_path_factory.mktemp("ckpt")
    for fmt in ("full", "sharded"):
        mgr = CheckpointManager(root / fmt, format=fmt, keep=3)
        make_run(manager=mgr, every=2).trainer.fit()
    return root


def test_keep_k_latest_and_the_files_are_checksummed(saved):
    for fmt in ("full", "sharded"):
        mgr = CheckpointManager(saved / fmt, format=fmt)
        assert [p.name for p in mgr.complete()] == ["step_00000002", "step_00000004", "step_00000006"]
        assert mgr.latest().name == "step_00000006" == (saved / fmt / "latest").read_text().strip()
        meta = verify(mgr.latest())
        assert meta["state_format"] == STATE_FORMAT and meta["world_size"] == 1 and meta["format"] == fmt
        assert meta["code"]["nanodist"] == nd.__version__ and meta["config"]["steps"] == 6
        assert meta["files"] and all(len(f["crc32"]) == 8 for f in meta["files"].values())


def _damaged_copy(saved, tmp_path, fmt):
    d = tmp_path / fmt
    shutil.copytree(saved / fmt, d)
    newest = d / "step_00000006"
    files = [f for f in newest.rglob("*") if f.is_file() and f.name != "meta.json"]
    victim = max(files, key=lambda f: f.stat().st_size)
    return d, victim


@pytest.mark.parametrize("fmt", ["full", "sharded"])
@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_file_is_named_and_the_manager_falls_back(saved, tmp_path, fmt, damage):
    d, victim = _damaged_copy(saved, tmp_path, fmt)
    data = victim.read_bytes()
    if damage == "truncated":
        victim.write_bytes(data[:len(data) // 2])
    else:  # one flipped byte, same size
        victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with pytest.raises(CheckpointError, match=f"{victim}.* is {damage}"):
        verify(d / "step_00000006")
    mgr = CheckpointManager(d, format=fmt)
    with pytest.warns(UserWarning, match=f"{victim.name}.*falling back to the previous checkpoint"):
        found = mgr.find("auto")
    assert found.name == "step_00000004"
    with pytest.raises(CheckpointError, match=damage):
        mgr.find(d / "step_00000006")  # asked for by path: an error, no silent substitute
    run = make_run()
    assert mgr.resume(run.trainer, "auto") == found and run.trainer.step == 4


KILL_IN_SAVE = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import torch
from tests.test_checkpoint import make_run
from nanodist import checkpoint
from nanodist.checkpoint import CheckpointManager
mgr = CheckpointManager({directory!r}, format={fmt!r})
run = make_run(manager=mgr, every=2)
run.trainer.fit(max_steps=2)                        # step_00000002: committed
original = torch.save
def half_then_die(obj, f, *a, **k):                 # the full format: half the file written, then SIGKILL
    original(obj, f, *a, **k); f.flush(); f.truncate(f.tell() // 2); os.kill(os.getpid(), signal.SIGKILL)
torch.save = half_then_die
checkpoint.CheckpointManager._commit = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # sharded: before rename
run.trainer.fit(max_steps=2)                        # dies in the save of step 4
"""


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_usable(tmp_path, fmt):
    repo = str(Path(__file__).resolve().parents[1])
    code = KILL_IN_SAVE.format(repo=repo, directory=str(tmp_path), fmt=fmt)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=repo,
                         env={**os.environ, "NANODIST_TIMEOUT": "60"})
    assert out.returncode == -9, out.stderr[-2000:]
    partial = list(tmp_path.glob(".tmp-step_00000004-*"))
    assert len(partial) == 1 and any(f.is_file() for f in partial[0].rglob("*")), "the save died midway"
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    mgr = CheckpointManager(tmp_path, format=fmt)
    assert [p.name for p in mgr.complete()] == ["step_00000002"]  # the partial one is not a checkpoint
    run = make_run(manager=mgr, every=2)
    assert mgr.resume(run.trainer, "auto").name == "step_00000002" and run.trainer.step == 2
    run.trainer.fit()  # the next save cleans the partial one up
    assert not list(tmp_path.glob(".tmp-*"))
    assert [p.name for p in mgr.complete()] == ["step_00000002", "step_00000004", "step_00000006"]


class _RunsCode:
    """A pickle that would run `touch <marker>` when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_pickle_is_refused_and_never_runs(saved, tmp_path):
    marker = tmp_path / "pwned"
    # sharded: DCP's .metadata replaced by a pickle that calls os.system
    d = tmp_path / "sharded"
    shutil.copytree(saved / "sharded", d)
    step = d / "step_00000006"
    (step / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    meta = read_meta(step)
    meta["files"].pop(".metadata")  # an attacker who rewrites the checksums too
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="refusing to load this checkpoint: its .metadata asks for "
                                              "(posix|os).system"):
        load(step, make_run().trainer)
    # full: state.pt replaced likewise; torch.load(weights_only=True) refuses it
    d = tmp_path / "full"
    shutil.copytree(saved / "full", d)
    step = d / "step_00000006"
    with open(step / "state.pt", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    meta = read_meta(step)
    meta["files"].pop("state.pt")
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"cannot read .*state.pt: UnpicklingError.*weights_only"):
        load(step, make_run().trainer)
    assert not marker.exists(), "the crafted pickle ran"


def test_a_checkpoint_of_another_model_optimizer_or_format_is_refused_saying_what_differs(saved, tmp_path):
    step = saved / "sharded" / "step_00000006"
    args = make_args("--model", "small")
    other = experiment.build(args, experiment.load_data(args), Group.world(), wrapper="single", optimizer="adamw")
    with pytest.raises(CheckpointError, match=r"another model: .*shape"):
        load(step, other.trainer)
    with pytest.raises(CheckpointError, match=r"holds the state of AdamW.*this run uses ShardedOptimizer"):
        load(step, make_run("none", "dist-muon").trainer)
    shutil.copytree(step, tmp_path / "old")
    meta = read_meta(tmp_path / "old")
    meta["state_format"] = STATE_FORMAT + 1
    (tmp_path / "old" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"state format {STATE_FORMAT + 1} .* this code reads format "
                                              f"{STATE_FORMAT}"):
        load(tmp_path / "old", make_run().trainer)


def test_no_checkpoint_starts_fresh_and_an_unwritable_directory_fails_first(tmp_path, capsys):
    mgr = CheckpointManager(tmp_path / "new")
    run = make_run()
    assert mgr.resume(run.trainer, "auto") is None and run.trainer.step == 0
    assert "no usable checkpoint in" in capsys.readouterr().out
    assert mgr.resume(run.trainer, "none") is None
    with pytest.raises(CheckpointError, match="is not a complete checkpoint"):
        mgr.resume(run.trainer, tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not writable.*--checkpoint-dir"):
        CheckpointManager(tmp_path / "file" / "ckpt")
    for bad, says in (({"format": "zip"}, "format must be one of full, sharded"), ({"keep": 0}, "keep must be")):
        with pytest.raises(ValueError, match=says):
            CheckpointManager(tmp_path / "x", **bad)


def test_a_run_that_stopped_itself_stops_again_when_restarted(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.mark_stopped("step 3: the loss is nan on rank 1")
    with pytest.raises(CheckpointError, match="stopped itself earlier.*loss is nan on rank 1.*STOPPED"):
        mgr.resume(make_run().trainer, "auto")


def test_a_restart_that_starts_fresh_still_stops_and_a_new_fresh_run_clears_the_stop(tmp_path, monkeypatch):
    """--resume none under torchrun restarts: before, every restart retrained into the same NaN."""
    mgr = CheckpointManager(tmp_path)
    mgr.mark_stopped("step 3: the loss is nan on rank 1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(CheckpointError, match="stopped itself earlier.*loss is nan"):
        mgr.find("none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new run, asked to start fresh
    assert mgr.find("none") is None and not (tmp_path / "STOPPED").exists()


def test_the_lab_restarted_after_a_nan_stop_stops_at_once(tmp_path):
    ck = tmp_path / "ck"
    CheckpointManager(ck).mark_stopped("step 3: the loss is nan on rank 1")
    with pytest.raises(nd.LaunchError) as e:
        nd.launch("lab06_checkpoint", nproc=1, args=TINY + ["--checkpoint-dir", str(ck)], timeout=LAUNCH_S,
                  echo=False, env={"NANODIST_RESULTS_DIR": str(tmp_path / "r")})
    assert "stopped itself earlier" in str(e.value) and "the loss is nan on rank 1" in str(e.value)


# ----------------------------------------------------------------------------- hostile files (issue 25, first items)

def test_a_damaged_latest_pointer_or_meta_falls_back_to_an_intact_checkpoint(saved, tmp_path):
    """A binary `latest`, a directory named `latest`, or a newest step whose meta.json holds `[]`: find() warns and
    takes the newest intact checkpoint instead of crashing (on main before this, each was a raw traceback)."""
    for case in ("binary latest", "directory latest", "meta.json []"):
        d = tmp_path / case.replace(" ", "-")
        shutil.copytree(saved / "full", d)
        if case == "binary latest":
            (d / "latest").write_bytes(b"\xff\xfe\x00step_\x80")
            want = "step_00000006"  # the pointer is ignored; the newest committed step is intact
        elif case == "directory latest":
            (d / "latest").unlink()
            (d / "latest").mkdir()
            want = "step_00000006"
        else:
            (d / "step_00000006" / "meta.json").write_text("[]")
            want = "step_00000004"
        mgr = CheckpointManager(d, format="full")
        if want == "step_00000004":
            with pytest.warns(UserWarning, match="meta.json is corrupted.*falling back"):
                found = mgr.find("auto")
        else:
            found = mgr.find("auto")
        assert found.name == want, case


def test_an_empty_checkpoint_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for empty in ("", "  "):
        with pytest.raises(CheckpointError, match="the checkpoint directory is empty"):
            CheckpointManager(empty)
    assert not list(tmp_path.iterdir()), "nothing may be written where the run started"
    out = run_script(Path(__file__).resolve().parents[1] / "labs" / "lab06_checkpoint.py", [*TINY, "--checkpoint-dir="],
                     env={**os.environ, "NANODIST_RESULTS_DIR": str(tmp_path / "r")}, timeout=120)
    assert out.returncode != 0 and "--checkpoint-dir is empty" in out.stderr + out.stdout
    assert not list(tmp_path.glob("step_*")) and not (tmp_path / "latest").exists()


def test_stopped_is_never_written_or_read_through_a_symbolic_link(tmp_path):
    ck, other = tmp_path / "ck", tmp_path / "precious.txt"
    mgr = CheckpointManager(ck)
    other.write_text("someone else's file\n")
    (ck / "STOPPED").symlink_to(other)
    with pytest.raises(CheckpointError, match="STOPPED is a symbolic link"):
        mgr.find("auto")  # the other file's content is never printed as a stop reason
    mgr.mark_stopped("step 3: the loss is nan on rank 0")
    assert other.read_text() == "someone else's file\n"  # the link was replaced, its target untouched
    assert not (ck / "STOPPED").is_symlink() and "loss is nan" in mgr.stopped_reason()
    (ck / "STOPPED").unlink()
    (ck / "STOPPED").symlink_to(tmp_path / "nowhere")  # a dangling link creates no file elsewhere
    mgr.mark_stopped("again")
    assert not (tmp_path / "nowhere").exists() and mgr.stopped_reason() == "again"


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_load_checks_the_checksums_it_saved(saved, tmp_path, fmt):
    """One flipped byte: load(path) itself refuses it (before, only find() and resume() verified)."""
    d, victim = _damaged_copy(saved, tmp_path, fmt)
    data = victim.read_bytes()
    victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with pytest.raises(CheckpointError, match="checksum differs"):
        load(d / "step_00000006", make_run().trainer)


def test_a_failure_inside_dcp_is_a_checkpoint_error_carrying_its_cause(saved, tmp_path):
    """DCP's CheckpointException derives from BaseException (a user's `except Exception` misses it) and names only
    the ranks: a truncated shard must come out as a CheckpointError that says what failed."""
    d, victim = _damaged_copy(saved, tmp_path, "sharded")
    victim.write_bytes(victim.read_bytes()[:64])
    with pytest.raises(CheckpointError, match=r"cannot load the sharded checkpoint .*: rank 0: EOFError") as e:
        load(d / "step_00000006", make_run().trainer, verify_files=False)
    assert isinstance(e.value, Exception)


# ----------------------------------------------------------------------------- reads stay inside, never block

def _rewrite_metadata(step: Path, change) -> None:
    """An attacker's edit of a sharded checkpoint: DCP's .metadata changed (read with torch's own unpickler, which
    trusts it), and meta.json's checksums made to agree, so that only the loader's own checks stand."""
    meta_file = step / ".metadata"
    with open(meta_file, "rb") as f:
        metadata = pickle.load(f)
    change(metadata)
    with open(meta_file, "wb") as f:
        pickle.dump(metadata, f)
    meta = json.loads((step / "meta.json").read_text())
    meta["files"][".metadata"] = {"bytes": meta_file.stat().st_size, "crc32": checkpoint._crc32(meta_file)}
    (step / "meta.json").write_text(json.dumps(meta))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["absolute", "parent", "fifo", "link"])
def test_a_crafted_metadata_never_reads_outside_the_checkpoint_or_blocks(saved, tmp_path, target):
    d, _ = _damaged_copy(saved, tmp_path, "sharded")
    step = d / "step_00000006"
    secret = tmp_path / "secret.txt"
    secret.write_text("run_id: someone else's")
    if target in ("absolute", "parent"):
        where = str(secret) if target == "absolute" else "../../secret.txt"

        def change(metadata):
            for info in metadata.storage_data.values():
                info.relative_path = where
        _rewrite_metadata(step, change)
        says = "outside the checkpoint's own files"
    else:  # the data file itself replaced by a FIFO (the read would block forever) or a link out of the checkpoint
        data = next(step.glob("*.distcp"))
        data.unlink()
        if target == "fifo":
            os.mkfifo(data)
            says = "not a regular file"
        else:
            data.symlink_to(secret)
            says = "is a symbolic link"
    for verify_files in (True, False):  # refused by the checksums' pass, and by the loader itself
        with pytest.raises(CheckpointError, match=says):
            load(step, make_run().trainer, verify_files=verify_files)
    if target == "fifo":  # meta.json a FIFO: find() passes over it to the intact step 4, without blocking
        meta = step / "meta.json"
        meta.unlink()
        os.mkfifo(meta)
        with pytest.warns(UserWarning, match="not a regular file"):
            assert CheckpointManager(d).find("auto") == d / "step_00000004"


def test_a_step_folder_linked_from_elsewhere_is_not_a_checkpoint_of_this_folder(saved, tmp_path):
    d, _ = _damaged_copy(saved, tmp_path, "full")
    outside = tmp_path / "elsewhere"
    (d / "step_00000006").rename(outside)
    (d / "step_00000009").symlink_to(outside)
    (d / "latest").write_text("step_00000009\n")
    assert CheckpointManager(d).find("auto") == d / "step_00000004"


# ----------------------------------------------------------------------------- asynchronous saves, re-saves

def async_wait_worker(rank, world, directory):
    """After wait(), every rank finds the checkpoint just saved (before, only rank 0 had committed it); a failure of
    rank 0's commit is raised by wait() on every rank."""
    found = []
    for fmt in ("full", "sharded"):
        mgr = CheckpointManager(Path(directory) / fmt, format=fmt, async_save=True, keep=2)
        run = make_run("nanodist-pg", "adamw")
        for _ in range(5):
            run.trainer.fit(max_steps=1)
            mgr.save(run.trainer)
            mgr.wait()
            latest = mgr.latest()
            found.append(latest is not None and latest.name == f"step_{run.trainer.step:08d}")
        if rank == 0:
            def broken(*args):
                raise OSError(28, "No space left on device (simulated)")
            mgr._commit = broken
        run.trainer.fit(max_steps=1)
        mgr.save(run.trainer)
        try:
            mgr.wait()
            found.append("no error")
        except CheckpointError as e:
            found.append(str(e))
    return found


@pytest.mark.dist
def test_wait_returns_when_the_asynchronous_save_is_committed_on_every_rank(tmp_path):
    for rank, found in enumerate(spawn(async_wait_worker, 3, args=(str(tmp_path),), timeout=120)):
        for fmt, part in (("full", found[:6]), ("sharded", found[6:])):
            assert part[:5] == [True] * 5, (rank, fmt, part)
            assert "failed on rank 0" in part[5] and "No space left on device" in part[5], (rank, fmt, part[5])


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_saving_a_step_again_replaces_it_in_one_step(tmp_path, fmt, monkeypatch):
    """A resumed run saving a step that exists: at every file operation of the commit, the step is there (old or
    new), and afterwards it is the new one."""
    mgr = CheckpointManager(tmp_path, format=fmt, record_fingerprint=True)
    run = make_run()
    run.trainer.fit(max_steps=2)
    mgr.save(run.trainer)
    old = read_meta(tmp_path / "step_00000002")["fingerprint"]
    with torch.no_grad():
        next(run.model.parameters()).add_(1.0)  # the same step, another state
    seen = []

    def spy(fn):
        def call(*args, **kwargs):
            seen.append(os.path.isfile(tmp_path / "step_00000002" / "meta.json"))
            out = fn(*args, **kwargs)
            seen.append(os.path.isfile(tmp_path / "step_00000002" / "meta.json"))
            return out
        return call

    for name in ("rename", "replace"):
        monkeypatch.setattr(checkpoint.os, name, spy(getattr(os, name)))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", spy(shutil.rmtree))
    monkeypatch.setattr(checkpoint, "_rename_exchange", spy(checkpoint._rename_exchange))
    mgr.save(run.trainer)
    assert seen and all(seen), seen
    assert read_meta(tmp_path / "step_00000002")["fingerprint"] not in (old, None)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ----------------------------------------------------------------------------- hostile files, several ranks

def hostile_worker(rank, world, directory):
    """Checkpoints written by `world` ranks (FSDP, both formats), then damaged by rank 0 while the others wait:
    every rank must refuse each one with the same CheckpointError (or fall back), none may hang or read outside."""
    from torch import distributed as dist
    root = Path(directory)
    said = {}
    for fmt in ("sharded", "full"):
        d = root / fmt
        mgr = CheckpointManager(d, format=fmt, keep=3)
        run = make_run("fsdp", group=None, manager=mgr, every=2)
        run.trainer.fit(max_steps=4)
        mgr.wait()
        step = d / "step_00000004"
        cases = {}
        if fmt == "sharded":
            cases["flipped byte"] = "checksum differs"
            cases["metadata pointing outside"] = "outside the checkpoint's own files"
            cases["a FIFO for a shard"] = "not a regular file"
        else:
            cases["flipped byte"] = "checksum differs"
        for case, expect in cases.items():
            work = root / f"{fmt}-{case.replace(' ', '-')}"
            if rank == 0:
                shutil.copytree(d, work)
                target = work / "step_00000004"
                shards = sorted(f for f in target.rglob("*") if f.is_file() and f.name not in ("meta.json", ".metadata"))
                victim = max(shards, key=lambda f: f.stat().st_size)
                if case == "flipped byte":
                    data = victim.read_bytes()
                    victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
                elif case == "metadata pointing outside":
                    (root / "secret.txt").write_text("someone else's")

                    def change(metadata):
                        for info in metadata.storage_data.values():
                            info.relative_path = "../../secret.txt"
                    _rewrite_metadata(target, change)
                else:
                    victim.unlink()
                    os.mkfifo(victim)
            dist.barrier()
            for verify_files in (True, False) if case != "flipped byte" else (True,):
                try:
                    load(work / "step_00000004", make_run("fsdp").trainer, verify_files=verify_files)
                    said[fmt, case, verify_files] = "loaded"
                except CheckpointError as e:
                    said[fmt, case, verify_files] = expect in str(e) or str(e)[:300]
        # a damaged pointer: every rank falls back to the intact newest step; a linked STOPPED is refused
        if rank == 0:
            (d / "latest").write_bytes(b"\xff\xfe\x00step_\x80")
        dist.barrier()
        said[fmt, "binary latest", None] = CheckpointManager(d, format=fmt).find("auto") == step
        dist.barrier()
        if rank == 0:
            (root / "precious.txt").write_text("keep me")
            (d / "STOPPED").symlink_to(root / "precious.txt")
        dist.barrier()
        try:
            CheckpointManager(d, format=fmt).find("auto")
            said[fmt, "linked STOPPED", None] = "read"
        except CheckpointError as e:
            said[fmt, "linked STOPPED", None] = "STOPPED is a symbolic link" in str(e) or str(e)[:300]
        dist.barrier()
    return said


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_hostile_files_are_refused_on_every_rank(tmp_path, world):
    """The one-process cases above, with checkpoints written by several ranks: a flipped byte, a .metadata that
    points outside, a FIFO for a shard (it would block), a binary `latest`, a linked STOPPED."""
    outs = spawn(hostile_worker, world, args=(str(tmp_path),), timeout=120)
    for rank, said in enumerate(outs):
        wrong = {k: v for k, v in said.items() if v is not True}
        assert not wrong, (rank, wrong)
        assert len(said) == 10
    assert outs[0] == outs[-1]


# ----------------------------------------------------------------------------- across wrappers

CROSS = [("nanodist-pg", "adamw"), ("fsdp", "adamw"), ("fsdp2", "adamw")]


def cross_worker(rank, world, directory, old_fsdp):
    """Saved by each wrapper at W = 2, loaded into every other: the state is the saved one, name for name (the
    fingerprint is of whole tensors by name). old_fsdp: nanodist.FSDP's checkpoints as they were before they kept
    a tied parameter under each of its names."""
    from nanodist.fsdp import FSDP
    aliases = FSDP._aliases
    out = {}
    for fmt in ("sharded", "full"):
        for src in CROSS:
            if old_fsdp and src[0] != "fsdp":
                continue  # only nanodist.FSDP's checkpoints were saved otherwise before
            d = Path(directory) / f"{fmt}-{src[0]}"
            mgr = CheckpointManager(d, format=fmt)
            a = make_run(*src)
            a.trainer.fit(max_steps=2)
            if old_fsdp:  # saved by the code before: the tied lm_head.weight only under wte.weight
                FSDP._aliases = lambda self: {}
            mgr.save(a.trainer)
            FSDP._aliases = aliases
            saved = fingerprint(a.trainer)  # this code's, whatever code saved the checkpoint
            for dst in CROSS:
                b = make_run(*dst)
                try:
                    load(d / "step_00000002", b.trainer)
                    out[fmt, src[0], dst[0]] = saved == fingerprint(b.trainer)
                except CheckpointError as e:
                    out[fmt, src[0], dst[0]] = str(e)[:300]
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world, old_fsdp", [(3, False), (2, True)])
def test_a_checkpoint_loads_into_any_other_wrapper(tmp_path, world, old_fsdp):
    for rank_out in spawn(cross_worker, world, args=(str(tmp_path), old_fsdp), timeout=120):
        assert len(rank_out) == 2 * len(CROSS) * (1 if old_fsdp else len(CROSS))
        wrong = {k: v for k, v in rank_out.items() if v is not True}
        assert not wrong, wrong


OPTIMIZER_CROSS = [("nanodist-pg", "adamw"), ("none", "dist-adamw"), ("none", "zero1-adamw"), ("fsdp", "adamw")]
MUON_CROSS = [("nanodist-pg", "muon"), ("none", "dist-muon")]  # torch's Muon + AdamW; DistMuon + DistAdamW


def optimizer_cross_worker(rank, world, directory, setups):
    """AdamW's state saved by torch's AdamW behind DDP, by DistAdamW (slices of every tensor) and by ZeroOptimizer
    (whole tensors on their owners), loaded into each of the others: the same moments, name for name."""
    out = {}
    for fmt in ("sharded", "full"):
        for src in setups:
            d = Path(directory) / f"{fmt}-{src[0]}-{src[1]}"
            a = make_run(*src)
            a.trainer.fit(max_steps=2)
            CheckpointManager(d, format=fmt).save(a.trainer)
            saved = fingerprint(a.trainer)
            a.trainer.fit(max_steps=2)  # two more steps: the second one's loss depends on the moments saved
            for dst in setups:
                if dst == src:
                    continue
                b = make_run(*dst)
                try:
                    load(d / "step_00000002", b.trainer)
                    same = saved == fingerprint(b.trainer)
                    b.trainer.fit(max_steps=2)
                    # another reduction order: equal up to float rounding (1e-5; zeroed moments move it ~1e-2)
                    la, lb = a.trainer.history[-1]["loss"], b.trainer.history[-1]["loss"]
                    out[fmt, "+".join(src), "+".join(dst)] = same and abs(la - lb) <= 1e-5 * abs(la) or (same, la, lb)
                except CheckpointError as e:
                    out[fmt, "+".join(src), "+".join(dst)] = str(e)[:300]
    return out


@pytest.mark.dist
@pytest.mark.parametrize("setups, world", [(OPTIMIZER_CROSS, 2), (MUON_CROSS, 2), (OPTIMIZER_CROSS[:2], 1)],
                         ids=["adamw", "muon", "adamw-1"])
def test_optimizer_state_loads_across_sharded_and_unsharded_optimizers(tmp_path, setups, world):
    for rank_out in spawn(optimizer_cross_worker, world, args=(str(tmp_path), setups), timeout=120):
        assert len(rank_out) == 2 * len(setups) * (len(setups) - 1)
        wrong = {k: v for k, v in rank_out.items() if v is not True}
        assert not wrong, wrong


def test_a_checkpoint_signed_before_the_rule_was_recorded_still_loads(tmp_path):
    """Checkpoints written before the signature named the update rule: the same optimizer class loads them, and
    MuonAdamW's Muon group, signed "other" then, still matches."""
    a = make_run("single", "muon")
    a.trainer.fit(max_steps=2)
    CheckpointManager(tmp_path, format="full").save(a.trainer)
    meta_file = tmp_path / "step_00000002" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["signature"].pop("algorithm")
    for g in meta["signature"]["param_groups"]:
        g["kind"] = "other" if g["kind"] == "muon" else g["kind"]
    meta_file.write_text(json.dumps(meta))
    b = make_run("single", "muon")
    load(tmp_path / "step_00000002", b.trainer)
    assert fingerprint(b.trainer) == fingerprint(a.trainer)


# ----------------------------------------------------------------------------- one run per folder

def _lock_as(directory: Path, **holder) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": os.getpid(), "started": None, "torchrun_run": None,
            "run_id": "run-A", "since": "2026-11-25T00:00:00+00:00"}
    (directory / "LOCK").write_text(json.dumps({**base, **holder}))


def test_a_folder_belongs_to_one_run_at_a_time(tmp_path, monkeypatch):
    """A live run elsewhere holds the folder: refused, naming it and how to break a stale lock. Taken over from a
    holder that died on this host (kill -9, then resume), from the same torchrun run (a restart) and by this very
    process; never from another host. close() gives the folder up."""
    trainer = make_run().trainer

    def claim(directory):  # the first save or resume takes the folder; constructing a manager takes nothing
        mgr = CheckpointManager(directory)
        mgr.resume(trainer, "none")
        return mgr

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        _lock_as(tmp_path / "a", pid=live.pid)
        with pytest.raises(CheckpointError, match=rf"in use by another run: process {live.pid} on .*run-A.*remove "):
            claim(tmp_path / "a")
        assert CheckpointManager(tmp_path / "a").find("auto") is None  # looking is not taking
        _lock_as(tmp_path / "b", pid=live.pid, host="another-host")
        with pytest.raises(CheckpointError, match="in use by another run"):
            claim(tmp_path / "b")
        _lock_as(tmp_path / "c", pid=dead.pid)
        mgr = claim(tmp_path / "c")
        assert json.loads((tmp_path / "c" / "LOCK").read_text())["pid"] == os.getpid()
        mgr.close()
        assert not (tmp_path / "c" / "LOCK").exists()
        _lock_as(tmp_path / "d", pid=live.pid, torchrun_run="job-7")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
        claim(tmp_path / "d")  # the same torchrun run, restarted
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id names no run
        _lock_as(tmp_path / "e", pid=live.pid, torchrun_run="none")
        with pytest.raises(CheckpointError, match="in use by another run"):
            claim(tmp_path / "e")
    finally:
        live.kill()
        live.wait()
    first = claim(tmp_path / "f")
    claim(tmp_path / "f")  # this process again (a notebook making a second manager)
    trainer.fit(max_steps=1)
    first.save(trainer)
    assert json.loads((tmp_path / "f" / "LOCK").read_text())["run_id"] == trainer.run_id
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "LOCK").symlink_to(tmp_path / "f" / "LOCK")
    with pytest.raises(CheckpointError, match="symbolic link"):
        claim(tmp_path / "g")
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "LOCK").write_bytes(b"\x00\xff")
    with pytest.raises(CheckpointError, match="does not say which run holds this folder"):
        claim(tmp_path / "h")


def from_one_process_worker(rank, world, root):
    """A one-process checkpoint (the `saved` fixture: bare model, AdamW) into DDP, FSDP and FSDP2 at W = 2."""
    out = {}
    for fmt in ("full", "sharded"):
        step = Path(root) / fmt / "step_00000006"
        alone = make_run()  # this rank alone, the bare model: the reference
        load(step, alone.trainer)
        want = fingerprint(alone.trainer)
        for dst in CROSS:
            b = make_run(*dst)
            load(step, b.trainer)
            out[fmt, dst[0]] = want == fingerprint(b.trainer) and b.trainer.step == 6
    return out


@pytest.mark.dist
def test_a_one_process_checkpoint_loads_into_every_wrapper(saved):
    for rank_out in spawn(from_one_process_worker, 2, args=(str(saved),), timeout=120):
        assert rank_out and all(rank_out.values()), rank_out
