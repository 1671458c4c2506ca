"""Faults injected into real training jobs (CPU, gloo, 2 ranks): SIGKILL of a rank, kills during a checkpoint
save, corrupted / truncated / malicious checkpoint files, NaN gradients and losses, a SIGSTOPped rank.

Every job runs tests/train/fault_worker.py (launch/train.py plus fault hooks) with one command line that
includes --resume, as a restarting launcher would. Timings (recovery, detection latency) are printed, never
asserted; run with -s to see them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support import ONE_THREAD, console_script, free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("fault_worker.py"))
CONFIG = "configs/debug.json"
STEPS = 6
BASE = [
    "--config",
    CONFIG,
    "--resume",
    "--set",
    f"train.steps={STEPS}",
    "train.save_every=1",
    "train.eval_every=0",
    ONE_THREAD,
]
TIMEOUT = 300  # per job; a hang fails the test instead of stalling CI

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class Job:
    """A launcher started by the test, with every output line and its arrival time (time.monotonic)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None):
        self.marker = uuid.uuid4().hex  # inherited by every process of the job: how we find them
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "MOE_DIST_TEST_JOB": self.marker, **(env or {})}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # text mode splits tqdm's \r updates into lines too
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines if not line.startswith("train:"))

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        return next(((t, line) for t, line in list(self.lines) if t >= after and re.search(pattern, line)), None)

    def wait_for(self, condition, what: str, timeout: float = TIMEOUT) -> float:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended ({self.proc.returncode}) before {what}:\n{self.output()[-5000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.output()[-5000:]}")
            time.sleep(0.02)
        return time.monotonic()

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not finish in {timeout} s:\n{self.output()[-5000:]}") from None
        self._reader.join(10)
        return rc

    def pids(self, **env) -> list[int]:
        """Processes of this job whose environment holds all of `env` (e.g. RANK="1")."""
        want = {f"MOE_DIST_TEST_JOB={self.marker}".encode(), *(f"{k}={v}".encode() for k, v in env.items())}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                items = set((entry / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if want <= items:
                found.append(int(entry.name))
        return found

    def worker(self, rank: int, attempt: int = 0) -> int:
        pids = self.pids(RANK=str(rank), TORCHELASTIC_RESTART_COUNT=str(attempt))
        assert len(pids) == 1, f"rank {rank} attempt {attempt}: processes {pids}"
        return pids[0]

    def cleanup(self) -> None:
        """Kill whatever of this job is left (by pid: the launcher and its workers, stopped ones included)."""
        for pid in [self.proc.pid, *self.pids()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(30)


@pytest.fixture
def jobs():
    """Start jobs through this; they are killed at teardown, with DeepSpeed's shared-memory files they leave."""
    started: list[tuple[Job, int, float]] = []

    def start(
        nproc: int,
        args: list[str],
        max_restarts: int = 0,
        fault: dict | None = None,
        samples: Path | None = None,
        launcher: str = "torchrun",
        env: dict[str, str] | None = None,
    ) -> Job:
        port = free_port()
        if launcher == "torchrun":
            cmd = [
                console_script("torchrun"),
                "--nproc_per_node",
                str(nproc),
                "--master_port",
                str(port),
                "--max-restarts",
                str(max_restarts),
                "--shutdown-timeout",
                "2",
                WORKER,
                *args,
            ]
        else:
            assert nproc == 1
            cmd = [sys.executable, WORKER, *args]
        env = {**(env or {}), "FAULT": json.dumps(fault or {})}
        if samples is not None:
            samples.mkdir(parents=True, exist_ok=True)
            env["SAMPLES_DIR"] = str(samples)
        job = Job(cmd, env)
        started.append((job, port, time.time()))
        return job

    yield start
    for job, port, t0 in started:
        job.cleanup()
        for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            if f.stat().st_mtime >= t0 - 1:
                f.unlink(missing_ok=True)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is skipped


def _train(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if "loss" in r]


def _last_step(run_dir: Path) -> int:
    return max((r["step"] for r in _train(run_dir)), default=0)


def _complete(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(d.name[5:]) for d in root.glob("step_*") if (d / "meta.json").exists()) if root.exists() else []


def _samples(samples_dir: Path) -> dict[int, dict[int, list[int]]]:
    """{step: {micro-batch index: sequence offsets}} of the last attempt that ran each step, over all ranks."""
    seen: dict[int, dict[int, tuple[int, list[int]]]] = {}
    for f in samples_dir.glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            prev = seen.setdefault(r["step"], {}).get(r["micro"])
            if prev is None or r["attempt"] >= prev[0]:
                seen[r["step"]][r["micro"]] = (r["attempt"], r["starts"])
    return {s: {m: v[1] for m, v in micro.items()} for s, micro in seen.items()}


def _tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(step_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every fault below is compared with: 2 ranks, ZeRO 1, a checkpoint every step."""
    root = tmp_path_factory.mktemp("reference")
    port = free_port()
    cmd = [
        console_script("torchrun"),
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        WORKER,
        *BASE,
        "--run-dir",
        str(root / "run"),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SAMPLES_DIR": str(root / "samples")}
    (root / "samples").mkdir()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"\nreference run: {time.monotonic() - t0:.1f} s")
    records = _train(root / "run")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["skipped_steps"] == 0 for r in records)
    return {
        "run": root / "run",
        "losses": [r["loss"] for r in records],
        "lrs": [r["lr"] for r in records],
        "samples": _samples(root / "samples"),
    }


def test_sigkill_and_kills_during_saves_restart_and_reproduce_the_uninterrupted_losses(tmp_path, jobs, reference):
    """One job under `torchrun --max-restarts 3`, the same command line for every attempt:
    attempt 0: rank 1 gets SIGKILL from outside, once a random step k in 1..3 is logged;
    attempt 1: rank 0 dies (SIGKILL) halfway through writing its tensor file of step 5;
    attempt 2: rank 0 dies after meta.json of step 6 is complete in the temporary directory, before the rename;
    attempt 3 finishes. Each restart resumes from the last complete checkpoint, only the steps after it are
    recomputed, and the per-step losses equal the uninterrupted run's exactly. keep_last=3 prunes as it goes."""
    seed = int(os.environ.get("FAULT_SEED", random.randrange(1 << 30)))
    kill_after = random.Random(seed).randint(1, 3)
    run, samples = tmp_path / "run", tmp_path / "samples"
    fault = {
        "kill_in_save": [
            {"rank": 0, "step": 5, "where": "write", "attempt": 1},
            {"rank": 0, "step": 6, "where": "publish", "attempt": 2},
        ]
    }
    job = jobs(2, [*BASE, "train.keep_last=3", "--run-dir", str(run)], max_restarts=3, fault=fault, samples=samples)
    job.wait_for(lambda: _last_step(run) >= kill_after, f"step {kill_after}")
    os.kill(job.worker(rank=1, attempt=0), signal.SIGKILL)
    t_kill = time.monotonic()
    logged, complete = _last_step(run), _complete(run)
    assert job.wait() == 0, job.output()[-5000:]

    starts = [
        (t, int(m.group(1)) if (m := re.search(r"\(step (\d+)\)", line)) else 0)
        for t, line in job.lines
        if re.match(r"(resuming from |no checkpoint in )", line)
    ]
    assert len(starts) == 4, job.output()[-5000:]  # the first start and three restarts
    resumes = [step for _, step in starts[1:]]
    # The newest checkpoint complete at the kill, or one saved in the instant between our two reads.
    assert max(complete, default=0) <= resumes[0] <= logged + 1
    assert resumes[1:] == [4, 5]  # the interrupted saves of steps 5 and 6 were never picked
    records = _train(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == reference["losses"]  # exact: same data, state and reduction order
    assert _samples(samples) == reference["samples"]
    ran: dict[int, set[int]] = {}
    for f in samples.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            ran.setdefault(r["attempt"], set()).add(r["step"])
    for attempt, resumed_from, last in zip((1, 2, 3), resumes, (5, 6, STEPS)):
        assert sorted(ran[attempt]) == list(range(resumed_from + 1, last + 1))  # only the steps after the checkpoint
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4", "step_5", "step_6"]

    detected = job.first(r"failed \(exitcode: -?\d+\)", after=t_kill)
    first_new = job.first(r"train:.*\b%d/%d\b" % (resumes[0] + 1, STEPS), after=starts[1][0])
    print(
        f"\nSIGKILL rank 1 (FAULT_SEED={seed}) after step {logged} was logged: the launcher saw it after "
        f"{detected[0] - t_kill:.2f} s; restarted and resumed from step {resumes[0]} after "
        f"{starts[1][0] - t_kill:.1f} s"
        + (f", next step done after {first_new[0] - t_kill:.1f} s" if first_new else "")
        + f"; steps recomputed: {logged - resumes[0]}"
    )
    for attempt in (1, 2):
        died = job.first(r"failed \(exitcode: -?\d+\)", after=starts[attempt][0])
        t_back, step = starts[attempt + 1]
        print(
            f"SIGKILL in the save of step {step + 1} (attempt {attempt}): resumed from step {step} "
            f"{t_back - died[0]:.1f} s after the launcher saw the death; steps recomputed: 1"
        )


def test_corrupt_truncated_and_malicious_checkpoints_fall_back_and_data_resumes_at_dp1(tmp_path, jobs, reference):
    """The reference run (dp=2) with its three newest checkpoints damaged: step_6's tensor file replaced by a
    pickle that would create a sentinel file (with a matching sha256), step_5's truncated, one byte of
    step_4's flipped. Resume with one process: three warnings naming the files, resume from step_3, and the
    samples of steps 4-6 are exactly the uninterrupted run's."""
    run = tmp_path / "run"
    shutil.copytree(reference["run"], run)
    sentinel = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {sentinel}",)

    f6, f5, f4 = (run / f"checkpoints/step_{s}/rank00000.safetensors" for s in (6, 5, 4))
    f6.write_bytes(pickle.dumps(Payload()))
    meta6 = json.loads((f6.parent / "meta.json").read_text())
    meta6["files"][f6.name] = hashlib.sha256(f6.read_bytes()).hexdigest()  # the attacker fixed the digest
    (f6.parent / "meta.json").write_text(json.dumps(meta6))
    f5.write_bytes(f5.read_bytes()[: f5.stat().st_size // 2])
    data = bytearray(f4.read_bytes())
    data[-7] ^= 0x10
    f4.write_bytes(bytes(data))

    job = jobs(1, [*BASE, "--run-dir", str(run)], launcher="python", samples=tmp_path / "samples")
    assert job.wait() == 0, job.output()[-5000:]
    out = job.output()
    warnings = [line for line in out.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 3, out[-3000:]
    for line, f, why in zip(
        warnings, (f6, f5, f4), ("not a readable safetensors", "sha256 mismatch", "sha256 mismatch")
    ):
        assert str(f) in line and why in line, line
    assert "resuming from" in out and "(step 3)" in out
    assert not sentinel.exists()
    resumed = _samples(tmp_path / "samples")
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {s: reference["samples"][s] for s in (4, 5, 6)}  # dp=2 → dp=1: nothing repeated or skipped
    losses = [r["loss"] for r in _train(run)]
    assert losses == pytest.approx(reference["losses"], rel=1e-5)  # dp=1 sums in another order than dp=2


def test_nonfinite_gradient_or_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path, jobs, reference):
    """Step 3: a NaN in one element of rank 1's embedding gradient. Step 5: rank 0's loss is NaN while its
    gradients are finite (DeepSpeed alone would apply that step). Both steps are skipped everywhere: parameters
    and Adam state after them equal those before them bit for bit, and the LR schedule moves on. ZeRO 1 here
    (DeepSpeed's ZeRO optimizer, as ZeRO 2); ZeRO 0 (the torch optimizer) in the next test."""
    run = tmp_path / "run"
    fault = {"nonfinite": [{"rank": 1, "step": 3, "what": "grad"}, {"rank": 0, "step": 5, "what": "loss"}]}
    job = jobs(2, [*BASE, "--run-dir", str(run)], fault=fault)
    assert job.wait() == 0, job.output()[-5000:]
    out = job.output()
    assert re.search(r"warning: step 3: non-finite gradient on ranks? [01]", out), out[-3000:]
    assert "warning: step 5: non-finite loss on rank 0;" in out
    records = _train(run)
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 2, 2]
    assert [r["lr"] for r in records] == reference["lrs"]
    for before, skipped in ((2, 3), (4, 5)):
        a, b = _tensors(run / f"checkpoints/step_{before}"), _tensors(run / f"checkpoints/step_{skipped}")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"step {skipped} changed state"
        metas = [json.loads((run / f"checkpoints/step_{s}/meta.json").read_text()) for s in (before, skipped)]
        assert metas[0]["adam_step"] == metas[1]["adam_step"] == before - (before > 3)
    last, prev = _tensors(run / f"checkpoints/step_{STEPS}"), _tensors(run / f"checkpoints/step_{STEPS - 1}")
    assert all(torch.isfinite(v).all() for v in last.values())
    assert not torch.equal(last["embed.weight"], prev["embed.weight"])  # training goes on after a skip


def test_too_many_nonfinite_steps_in_a_row_stop_the_run(tmp_path, jobs):
    """ZeRO 0 (the torch optimizer itself): a skipped step changes nothing either; two in a row stop the run."""
    run = tmp_path / "run"
    fault = {"nonfinite": [{"rank": 1, "step": 2, "what": "grad"}, {"rank": 1, "step": 3, "what": "loss"}]}
    args = [*BASE, "deepspeed.zero_stage=0", "train.max_nonfinite_steps=2", "--run-dir", str(run)]
    job = jobs(2, args, fault=fault)
    assert job.wait() != 0
    out = job.output()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors, out[-3000:]  # both ranks stop (one decision); the launcher may cut the second one's output
    for line in errors:
        assert "step 3: 2 optimizer steps in a row skipped" in line and "train.max_nonfinite_steps=2" in line
    assert [r["skipped_steps"] for r in _train(run)] == [0, 1]
    a, b = _tensors(run / "checkpoints/step_1"), _tensors(run / "checkpoints/step_2")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigstopped_rank_makes_the_others_fail_with_a_named_timeout_then_restart_resumes(tmp_path, jobs, reference):
    """EP=2, so the first collective of a step is the expert all-to-all on a group DeepSpeed created (those
    default to a 30-minute timeout unless the mesh sets parallel.timeout_s on them). A checkpoint is saved every
    step, so the stop may also land in a save, bounded by train.save_timeout_s (set equal here)."""
    timeout_s, stop_after = 8, 2
    run = tmp_path / "run"
    args = [*BASE, "parallel.ep=2", f"parallel.timeout_s={timeout_s}", f"train.save_timeout_s={timeout_s}"]
    args += ["--run-dir", str(run)]
    job = jobs(2, args, max_restarts=1)
    job.wait_for(lambda: _last_step(run) >= stop_after, f"step {stop_after}")
    stopped = job.worker(rank=1, attempt=0)
    os.kill(stopped, signal.SIGSTOP)
    t_stop = time.monotonic()
    logged, complete = _last_step(run), _complete(run)
    job.wait_for(lambda: job.first(r"^error: ", after=t_stop) is not None, "rank 0's error")
    error = job.first(r"^error: ", after=t_stop)
    # torchrun now sends the stopped rank SIGTERM, which waits for SIGCONT, and SIGKILLs it after a fixed 30 s
    # grace; we do the SIGKILL at once to keep the test short. The restart path is torchrun's from here on.
    os.kill(stopped, signal.SIGKILL)
    assert job.wait() == 0, job.output()[-5000:]
    in_step = rf"step \d+: .+: collective timed out \(parallel\.timeout_s={timeout_s};"
    in_save = (
        rf"checkpoint save of step \d+: .+: (collective timed out \(train\.save_timeout_s={timeout_s};|"
        rf"rank 1 did not finish within train\.save_timeout_s={timeout_s})"
    )
    assert re.match(rf"error: ({in_step}|{in_save})", error[1]), error[1]
    resumed = job.first(r"resuming from .*\(step (\d+)\)", after=t_stop)
    assert resumed is not None
    resume_step = int(re.search(r"\(step (\d+)\)", resumed[1]).group(1))
    assert max(complete) <= resume_step <= logged + 1
    assert [r["loss"] for r in _train(run)] == pytest.approx(reference["losses"], rel=1e-5)  # EP=2 vs EP=1
    print(
        f"\nSIGSTOP rank 1 after step {logged}: rank 0 failed after {error[0] - t_stop:.1f} s "
        f"(timeout {timeout_s} s): {error[1][:160]}; resumed from step {resume_step} after "
        f"{resumed[0] - t_stop:.1f} s; steps recomputed: {logged - resume_step}"
    )


def test_an_aborted_nccl_communicator_ends_the_job_with_one_line_and_exit_1(tmp_path, jobs):
    """On NCCL a timed-out collective is the watchdog's: with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, which start-up
    sets over the launcher's 1 (torchrun's; it, and torch's default 3, end the process with SIGABRT), it aborts the
    group's communicators and the training thread's next collective raises DistBackendError. There is no NCCL on
    the CPU: the forward of step 2 raises that exception, with torch's text, and the job ends as the README says."""
    fault = {"nccl_abort": [{"rank": 0, "step": 2}]}
    args = [*BASE, "parallel.timeout_s=8", "--run-dir", str(tmp_path / "run")]
    job = jobs(1, args, fault=fault, launcher="python", env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert job.wait() == 1, job.output()[-5000:]
    seen = job.first(r"TORCH_NCCL_ASYNC_ERROR_HANDLING=\S*$")  # after the progress bar's text on its line
    assert seen is not None and seen[1].endswith("=2"), job.output()[-5000:]
    errors = [line for _, line in job.lines if re.match(r"error|Traceback|.*Error:", line)]
    assert len(errors) == 1, job.output()[-5000:]
    assert re.fullmatch(
        r"error: step 2: forward of micro-batch 0 \(MoE all-to-all\): collective timed out \(parallel\.timeout_s=8; "
        r"a rank died or stopped responding\): NCCL communicator was aborted on rank 0\. .* ran for 8012 "
        r"milliseconds before timing out\.",
        errors[0],
    ), errors[0]


def test_async_save_killed_while_writing_falls_back_and_equals_synchronous_saves(tmp_path, jobs, reference):
    """train.async_save: rank 1 dies (SIGKILL) in its background writer halfway through its file of step 5, while
    the training thread goes on. The unpublished step 5 is never picked: the restart resumes from step 4. Every
    checkpoint, and every loss, equals the synchronous reference run's bit for bit: the snapshot is the state. The
    snapshot goes through a 64 KiB staging buffer (32 KiB halves), smaller than the larger tensors and than the share
    of each rank: tensors are cut across its halves."""
    run = tmp_path / "run"
    fault = {"kill_in_save": [{"rank": 1, "step": 5, "where": "write", "attempt": 0}]}
    args = [*BASE, "train.async_save=true", "train.save_staging_mb=0.0625", "--run-dir", str(run)]
    job = jobs(2, args, max_restarts=1, fault=fault)
    assert job.wait() == 0, job.output()[-5000:]
    starts = [line for _, line in job.lines if re.match(r"(resuming from |no checkpoint in )", line)]
    assert len(starts) == 2 and "(step 4)" in starts[1], job.output()[-5000:]
    assert [r["loss"] for r in _train(run)] == reference["losses"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{s}" for s in range(1, STEPS + 1)]
    for step in range(1, STEPS + 1):
        ours, ref = _tensors(run / f"checkpoints/step_{step}"), _tensors(reference["run"] / f"checkpoints/step_{step}")
        assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours), f"step {step}"
    files = sorted(f.name for f in (run / f"checkpoints/step_{STEPS}").glob("*.safetensors"))
    assert files == ["rank00000.safetensors", "rank00001.safetensors"]  # both ranks write a share


def test_a_rank_stuck_writing_its_checkpoint_is_named_after_save_timeout(tmp_path, jobs):
    """Rank 1's disk hangs (its writer sleeps 120 s before closing its file of step 2). parallel.timeout_s is far
    longer; train.save_timeout_s=6 bounds the save: rank 0 stops with one line naming the save, the phase and
    rank 1, exit 1, and step 2 is never published."""
    run = tmp_path / "run"
    fault = {"stall_in_save": [{"rank": 1, "step": 2, "seconds": 120}]}
    args = [*BASE, "train.save_timeout_s=6", "parallel.timeout_s=300", "--run-dir", str(run)]
    job = jobs(2, args, fault=fault)
    t0 = time.monotonic()
    job.wait_for(lambda: job.first(r"^error: ") is not None, "rank 0's error")
    error = job.first(r"^error: ")
    assert job.wait() != 0
    assert error[1].startswith(
        "error: checkpoint save of step 2: waiting for every rank to write its tensor file: rank 1 did not finish "
        "within train.save_timeout_s=6"
    ), error[1]
    assert _complete(run) == [1]
    print(f"\nrank 1 stuck in the save of step 2: rank 0 stopped {error[0] - t0:.1f} s after the job started")
