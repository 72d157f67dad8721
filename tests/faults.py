"""Failures on purpose, for batch tests here, in subprocesses and in Ray workers (where a setup hook installs them).

A failing line: the text BREAK raises, OVERFLOW meets NaN logits (`failing_prompts`).

A stall: a process that must be interrupted at a known point (killed, or sent SIGINT) stops there and waits. Faults
are armed as files in the folder $RVQTTS_FAULTS names (`arm`): "synthesize-N" stalls a process as it starts to
synthesize line N; "write-NAME" as it writes file NAME (bytes that hold what the fault was armed with), all but
CUT_SHORT of them on disk, in the `Path.write_bytes` call that an atomic write (its temporary file) and a plain one
both make.
The first process to reach the point takes the fault (a rename: one process, once), writes its pid to the marker
`arm` returned, and waits; the test waits for the marker (`wait_for_stall`) and interrupts that pid. A fault nobody
takes does nothing; a stall that is never interrupted raises after STALL_SECONDS.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

BREAK = "Break."  # a batch line with this text fails
OVERFLOW = "Overflow."  # and one with this text meets NaN logits, as a float16 overflow would
FAULTS = "RVQTTS_FAULTS"  # the folder of armed faults
STALL_SECONDS = 120.0  # how long a stalled process waits to be interrupted before it gives up
PARTIAL = ".partial"  # rvqtts.support.files.atomic_path's temporary files: ".NAME.RANDOM.partial"
CUT_SHORT = 10  # bytes a stalled write has not written yet: any file cut there is damaged (a JSONL file mid-line)


def failing_prompts(original):
    """rvqtts.synthesis.pipeline.line_prompts (where every line starts, whichever path speaks it), except that the text
    BREAK raises RuntimeError("simulated failure") and OVERFLOW the NonFiniteError of a talker in float16."""

    def line_prompts(synth, line, *args):
        import torch

        from rvqtts.engine.model.sampling import NonFiniteError

        if line.text == BREAK:
            raise RuntimeError("simulated failure")
        if line.text == OVERFLOW:
            raise NonFiniteError("talker", torch.float16)
        yield from original(synth, line, *args)

    return line_prompts


def arm(folder: Path, fault: str, holding: str = "") -> Path:
    """Arm `fault` ("synthesize-N" or "write-NAME") in `folder` (the processes' $RVQTTS_FAULTS), a write's only
    where its bytes hold `holding`; the marker that the stalled process will write its pid to."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"stalled-{fault}"
    marker.unlink(missing_ok=True)  # an earlier test's
    (folder / f"armed-{fault}").write_text(holding)
    return marker


def disarm(folder: Path) -> None:
    """Remove the faults of `folder` that no process took (a test that failed early leaves none armed), and the
    markers of those taken."""
    for path in [*folder.glob("armed-*"), *folder.glob("stalled-*")]:
        path.unlink(missing_ok=True)


def wait_for_stall(marker: Path, process=None, timeout: float = 120.0) -> int:
    """The pid a stalled process wrote to `marker`, waited for until `timeout`; fails at once when `process`
    (a subprocess.Popen) ends first, with what it said."""
    from helpers import wait_until

    def stalled() -> bool:
        if process is not None and process.poll() is not None and not marker.exists():
            _, stderr = process.communicate()
            raise AssertionError(f"exit {process.returncode} before {marker.name}: {stderr[-3000:]}")
        return marker.exists()

    wait_until(stalled, timeout, f"a process to stall at {marker.name}")
    return int(marker.read_text())


def _take(fault: str, data: bytes | None = None) -> bool:
    """Whether this process takes the armed `fault` (only one process can: a rename); a write's (of `data`) only
    where the bytes hold what the fault was armed with."""
    folder = os.environ.get(FAULTS)
    if not folder:
        return False
    try:
        if data is not None and (Path(folder) / f"armed-{fault}").read_bytes() not in data:
            return False
        os.rename(Path(folder) / f"armed-{fault}", Path(folder) / f"taken-{fault}-{os.getpid()}")
    except FileNotFoundError:
        return False
    return True


def _stall(fault: str) -> None:
    """Say this process stalled at `fault` (its pid in the marker, written whole) and wait to be interrupted."""
    folder = Path(os.environ[FAULTS])
    pending = folder / f"pid-{fault}-{os.getpid()}"
    pending.write_text(str(os.getpid()))
    os.replace(pending, folder / f"stalled-{fault}")
    deadline = time.monotonic() + STALL_SECONDS
    while time.monotonic() < deadline:
        time.sleep(0.02)  # SIGINT raises KeyboardInterrupt here, SIGKILL ends the process here
    raise RuntimeError(f"fault {fault}: stalled for {STALL_SECONDS:g} s and nobody interrupted this process")


def stalling_prompts(original):
    """rvqtts.synthesis.pipeline.line_prompts, stalling at the start of the line an armed "synthesize-N" names."""

    def line_prompts(synth, line, *args):
        fault = f"synthesize-{line.utterance}"
        if _take(fault):
            _stall(fault)
        yield from original(synth, line, *args)

    return line_prompts


def output_name(path: Path) -> str:
    """The file a write to `path` makes: its own name, or for an atomic write's temporary file the target's."""
    name = path.name
    if name.startswith(".") and name.endswith(PARTIAL):
        return name[1 : -len(PARTIAL)].rpartition(".")[0]  # ".0002.wav.k3j_x9.partial" -> "0002.wav"
    return name


def stalling_write_bytes(original):
    """Path.write_bytes, stalling before the last CUT_SHORT bytes of the file an armed "write-NAME" names."""

    def write_bytes(self, data):
        fault = f"write-{output_name(self)}"
        if _take(fault, bytes(data)):
            with open(self, "wb") as most:
                most.write(bytes(data)[: max(0, len(data) - CUT_SHORT)])
            _stall(fault)
        return original(self, data)

    return write_bytes


def install_stalls() -> None:
    """This process's lines (their prompts) and Path.write_bytes stall where a fault is armed."""
    import rvqtts.synthesis.pipeline as pipeline

    pipeline.line_prompts = stalling_prompts(pipeline.line_prompts)
    Path.write_bytes = stalling_write_bytes(Path.write_bytes)


def break_lines() -> None:
    """A Ray worker_process_setup_hook: this process's lines fail on BREAK and stall where armed."""
    import rvqtts.synthesis.pipeline as pipeline

    install_stalls()
    pipeline.line_prompts = failing_prompts(pipeline.line_prompts)


def rvqtts_with_stalls() -> None:
    """`python -c 'import faults; faults.rvqtts_with_stalls()' ARGS...`: the `rvqtts ARGS...` command with the
    faults armed in $RVQTTS_FAULTS (a process to interrupt at a known point). Ctrl-C raises KeyboardInterrupt, as
    at a terminal, even where this process was started with SIGINT ignored (a shell's background job)."""
    from rvqtts.cli import main

    signal.signal(signal.SIGINT, signal.default_int_handler)
    install_stalls()
    sys.argv[0] = "rvqtts"
    main()


def zygote() -> None:
    """`python -c 'import faults; faults.zygote()'`: rvqtts's CLI and the model code (torch, qwen-tts) imported
    once, then a process forked per request, each running `rvqtts ARGS` with the armed faults as a process of its
    own (started in a fraction of a second, where a fresh Python takes seconds to import qwen-tts). One request at
    a time, a JSON line on stdin: {"arguments", "env", "cwd", "output"} (the file for the child's stdout and
    stderr); answered on stdout with {"pid"}, then, when the child ends, {"exit"} (a negative signal number for a
    child killed by a signal, as Popen.returncode). Ends at the end of stdin."""
    import json

    from rvqtts.cli import main
    from rvqtts.qwen.compat import qwen_tts

    qwen_tts()  # what a run imports lazily, imported before the fork
    install_stalls()
    answers = sys.stdout
    for request in map(json.loads, sys.stdin):
        answers.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            code = 1
            try:
                output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(output, 1)  # away from the answers' pipe
                os.dup2(output, 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.chdir(request["cwd"])
                os.environ.update(request["env"])
                signal.signal(signal.SIGINT, signal.default_int_handler)
                sys.argv = ["rvqtts", *request["arguments"]]
                try:
                    main()
                    code = 0
                except SystemExit as end:
                    code = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": child}), file=answers, flush=True)
        _, status = os.waitpid(child, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


class Zygote:
    """The test's side of `zygote`: `start` answers a Popen-like child (pid, poll, send_signal, kill,
    communicate); one child at a time."""

    def __init__(self, env: dict):
        import subprocess

        command = [sys.executable, "-c", "import faults; faults.zygote()"]
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.buffer = b""

    def answer(self, timeout: float | None) -> dict | None:
        """The zygote's next answer, or None if none came within `timeout` seconds (None: wait for it)."""
        import json
        import select

        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.process.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"the zygote ended (exit {self.process.wait()})")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def start(self, arguments: list[str], env: dict, cwd: Path) -> "Child":
        import json

        output = Path(cwd) / f"rvqtts-output-{time.monotonic_ns()}.txt"
        request = {"arguments": arguments, "env": env, "cwd": str(cwd), "output": str(output)}
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        answer = self.answer(timeout=60)
        assert answer is not None and "pid" in answer, answer
        return Child(self, answer["pid"], output)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


class Child:
    """A process `Zygote.start` forked, with the parts of subprocess.Popen the tests use."""

    def __init__(self, zygote: Zygote, pid: int, output: Path):
        self.zygote, self.pid, self.output, self.returncode = zygote, pid, output, None

    def poll(self) -> int | None:
        if self.returncode is None:
            answer = self.zygote.answer(timeout=0)
            if answer is not None:
                self.returncode = answer["exit"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            answer = self.zygote.answer(timeout)
            if answer is None:
                raise TimeoutError(f"rvqtts (pid {self.pid}) still runs after {timeout} s")
            self.returncode = answer["exit"]
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        """(None, what the child wrote to stdout and stderr) once it ended."""
        self.wait(timeout)
        return None, self.output.read_text(errors="replace")
