#!/usr/bin/env python3
"""The wheel as a user installs it: a fresh venv holding only torch and the wheel runs the README's quickstart.

For each torch version (2.11.0, the one verl's lock pins in scripts/requirements-torch211.txt, and 2.15.0, the
newest supported), this

1. makes a fresh venv (``uv venv``) and installs ``torch==VERSION`` into it (2.11.0's dependencies at that
   lock's versions), then the one ``fsdp_odc-*.whl`` of the wheel folder (``uv pip install``, no source
   builds), and nothing else;
2. copies the README's ``## Quickstart`` blocks out of README.md as they are written: the block after
   ``<!-- quickstart:train.py -->`` (a ```python fence) into ``train.py``, the one after
   ``<!-- quickstart:run -->`` (a ```bash fence) as the command, the one after ``<!-- quickstart:backend -->``
   (a ```python fence) for the second run;
3. runs the command as written (``torchrun --nproc-per-node 2 train.py``) with bash, in a scratch folder, the
   venv's bin first on PATH as an activated venv has it, and neither cargo nor rustc on PATH (checked), on CPU;
4. runs it again on a second train.py: the same script with its ``dist.init_process_group("gloo")`` line
   replaced by the backend block (``import odc`` and ``dist.init_process_group("odc")``), so that the process
   group's own collectives (clip_grad_norm_'s all-reduce among them) run on ODC too;
5. checks what each run prints: every rank its step lines (``rank R step S: loss L grad norm N``) for the
   same steps 0, 1, ..., each step's grad norm the same on every rank (clip_grad_norm_ all-reduces it), and
   the backend run's grad norms those of the gloo run (within 1.5e-4, about the fourth printed decimal: the
   same seeded model and data, only the collectives moved), which an all-reduce over ODC that summed wrong
   would not be (one that doubled its sums printed 0.0925 for 0.0654).

Then, as a Hugging Face user meets it, docs/trainers.md's ``SFTTrainer`` script: a fresh venv holding only the
wheel with its ``hf`` extra (``fsdp-odc[hf] @ file://...whl``: TRL, accelerate, transformers and the torch they
resolve to, nothing else), the blocks after ``<!-- hf:train_sft.py -->`` (```python), ``<!-- hf:fsdp2.yaml -->``
(```yaml) and ``<!-- hf:run -->`` (```bash, ``accelerate launch --config_file fsdp2.yaml train_sft.py``) written
and run as they are, on CPU; the Trainer's log must show one finite loss per step of the script's ``max_steps``
and the run's ``train_loss``.

A missing or misplaced block, a failed install or run, or a print that does not match fails the test (exit 1);
the time of each step (venv, installs, runs) is printed at the end.

    scripts/wheel-test.py [--wheels dist] [--torch 2.11.0,2.15.0] [--work target/wheel-test] [--no-hf]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = {"train.py": "python", "run": "bash", "backend": "python"}
GLOO_LINE = 'dist.init_process_group("gloo")'
# The ranks' prints share torchrun's output: a line may run on into another rank's (its newline written after
# the other's text), so a value ends where the number does.
NUMBER = r"([-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf))"
STEP = re.compile(rf"rank (\d+) step (\d+): loss {NUMBER} grad norm {NUMBER}")
# Torch versions and the constraints their install takes (the lock verl's pins come from, for 2.11).
CONSTRAINTS = {"2.11.0": ROOT / "scripts" / "requirements-torch211.txt"}
# docs/trainers.md's Hugging Face blocks (<!-- hf:NAME --> markers): the files the run block names, and the command.
HF_BLOCKS = {"train_sft.py": "python", "fsdp2.yaml": "yaml", "run": "bash"}
# A step's log line as the Trainer prints it on rank 0 ("{'loss': '4.559', 'grad_norm': ..."; transformers 5.24
# prints the values as strings, older releases as numbers).
HF_STEP = re.compile(rf"\{{'loss': '?{NUMBER}'?, 'grad_norm'")
# How far the backend run's printed grad norms may be from the gloo run's: about a unit of the fourth printed
# decimal (the gradients are summed in arrival order, so the last bits may differ; a wrong all-reduce is far off).
NORM_TOLERANCE = 1.5e-4


class Failure(Exception):
    """The test failed; the message says how."""


def quickstart(readme: Path) -> dict[str, str]:
    """The three marked blocks of the README's ``## Quickstart`` section, by marker name."""
    text = readme.read_text(encoding="utf-8")
    section = re.search(r"^## Quickstart\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        raise Failure(f"{readme} has no '## Quickstart' section")
    blocks = {}
    for name, lang in BLOCKS.items():
        marker = f"<!-- quickstart:{name} -->"
        if text.count(marker) != 1:
            raise Failure(f"{readme}: the marker {marker} appears {text.count(marker)} times (once, in "
                          f"'## Quickstart')")
        if marker not in section.group(1):
            raise Failure(f"{readme}: the marker {marker} is outside the '## Quickstart' section")
        fence = re.search(re.escape(marker) + r"[ \t]*\n```" + lang + r"[ \t]*\n(.*?)^```[ \t]*$", text, re.M | re.S)
        if fence is None:
            raise Failure(f"{readme}: {marker} is not followed by a ```{lang} fence")
        if not fence.group(1).strip():
            raise Failure(f"{readme}: the ```{lang} block after {marker} is empty")
        blocks[name] = fence.group(1)
    return blocks


def marked_blocks(path: Path, prefix: str, blocks: dict[str, str]) -> dict[str, str]:
    """The fenced blocks that follow ``<!-- PREFIX:NAME -->`` markers in ``path``, by name (each marker once)."""
    text = path.read_text(encoding="utf-8")
    found = {}
    for name, lang in blocks.items():
        marker = f"<!-- {prefix}:{name} -->"
        if text.count(marker) != 1:
            raise Failure(f"{path}: the marker {marker} appears {text.count(marker)} times (once)")
        fence = re.search(re.escape(marker) + r"[ \t]*\n```" + lang + r"[ \t]*\n(.*?)^```[ \t]*$", text, re.M | re.S)
        if fence is None or not fence.group(1).strip():
            raise Failure(f"{path}: {marker} is not followed by a non-empty ```{lang} fence")
        found[name] = fence.group(1)
    return found


def with_backend(train: str, backend: str) -> str:
    """train.py with its ``dist.init_process_group("gloo")`` line replaced by the backend block."""
    lines = train.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.strip() == GLOO_LINE]
    if len(at) != 1:
        raise Failure(f"the quickstart's train.py has {len(at)} lines '{GLOO_LINE}' (one, for the backend block to "
                      f"replace)")
    lines[at[0]] = backend if backend.endswith("\n") else backend + "\n"
    return "".join(lines)


def ranks_of(command: str) -> int:
    """The rank count the run block asks torchrun for."""
    m = re.search(r"--nproc[-_]per[-_]node[= ](\d+)", command)
    if m is None:
        raise Failure(f"the quickstart's run block names no --nproc-per-node: {command.strip()!r}")
    return int(m.group(1))


def steps_of(output: str, ranks: int, what: str) -> list[float]:
    """Checks a run's step lines; returns each step's grad norm (the same on every rank)."""
    seen: dict[tuple[int, int], tuple[float, float]] = {}
    for r, s, loss, norm in STEP.findall(output):
        key = (int(r), int(s))
        if key in seen:
            raise Failure(f"{what}: rank {r} printed step {s} twice")
        try:
            values = (float(loss), float(norm))
        except ValueError:
            raise Failure(f"{what}: rank {r} step {s}: loss {loss!r} grad norm {norm!r} are not numbers") from None
        if not all(math.isfinite(v) for v in values):
            raise Failure(f"{what}: rank {r} step {s}: loss {loss} grad norm {norm}")
        seen[key] = values
    if not seen:
        raise Failure(f"{what}: no 'rank R step S: loss L grad norm N' line")
    steps = sorted({s for _, s in seen})
    if steps != list(range(len(steps))):
        raise Failure(f"{what}: steps {steps}, expected 0 to {len(steps) - 1}")
    norms = []
    for s in steps:
        by_rank = {r: values[1] for (r, t), values in seen.items() if t == s}
        if sorted(by_rank) != list(range(ranks)):
            raise Failure(f"{what}: step {s} printed by ranks {sorted(by_rank)}, expected 0 to {ranks - 1}")
        if len(set(by_rank.values())) != 1:
            raise Failure(f"{what}: step {s}: the grad norms differ across ranks: {by_rank}")
        norms.append(by_rank[0])
    return norms


def run(cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: float, what: str) -> tuple[str, float]:
    """Runs ``cmd``; returns its output (stdout and stderr together) and its seconds, or fails naming ``what``."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        raise Failure(f"{what}: still running after {timeout:.0f} s; its output:\n{out}") from None
    seconds = time.monotonic() - t0
    if p.returncode != 0:
        raise Failure(f"{what}: exit status {p.returncode}; its output:\n{p.stdout}")
    return p.stdout, seconds


def find_uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv") or str(ROOT / ".tools" / "bin" / "uv")
    if not os.access(uv, os.X_OK):
        raise Failure("no uv (on PATH or in .tools/bin): run make setup")
    return uv


def the_wheel(folder: Path) -> Path:
    wheels = sorted(folder.glob("fsdp_odc-*.whl"))
    if len(wheels) != 1:
        raise Failure(f"expected one fsdp_odc-*.whl in {folder}, found {[w.name for w in wheels]}: run make wheel")
    return wheels[0]


def leg(version: str, wheel: Path, command: str, scripts: dict[str, str], work: Path, uv: str,
        times: list[tuple[str, float]]) -> None:
    """One torch version: the venv, the installs, the two runs and their checks."""
    venv = work / f"torch-{version}"
    shutil.rmtree(venv, ignore_errors=True)
    home = venv / "home"
    # What the user's shell would have: the venv's bin first (as `source .venv/bin/activate` puts it), the
    # system's folders, no Rust toolchain, nothing of this checkout's environment. uv keeps its cache, which
    # makes the install a matter of links once make setup has downloaded torch.
    path = f"{venv}/bin:/usr/bin:/bin"
    for tool in ("cargo", "rustc"):
        if shutil.which(tool, path=path):
            raise Failure(f"{tool} is on the test's PATH ({shutil.which(tool, path=path)}); the wheel must install "
                          f"and run without a Rust toolchain")
    cache = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, check=True).stdout.strip()
    env = {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8", "UV_CACHE_DIR": cache}
    # The network settings the installs need where the index is reached through a proxy or a certificate of
    # the site's own, as the user's shell has them; nothing else of this environment.
    env.update({k: v for k, v in os.environ.items() if k.startswith(("UV_", "PIP_", "SSL_CERT_"))
                or k.endswith("CA_BUNDLE") or k.lower() in ("https_proxy", "http_proxy", "no_proxy", "all_proxy")})
    env["UV_CACHE_DIR"] = cache
    python = str(venv / "bin" / "python")

    _, t = run([uv, "venv", "-q", "--python", "python3", str(venv)], env=env, cwd=work, timeout=120,
               what=f"torch {version}: uv venv")
    times.append((f"torch {version}: uv venv", t))
    home.mkdir()
    install = [uv, "pip", "install", "-q", "--no-build", "--python", python]
    constraints = ["-c", str(CONSTRAINTS[version])] if version in CONSTRAINTS else []
    _, t = run([*install, f"torch=={version}", *constraints], env=env, cwd=work, timeout=900,
               what=f"torch {version}: uv pip install torch=={version}")
    times.append((f"torch {version}: install torch", t))
    _, t = run([*install, str(wheel)], env=env, cwd=work, timeout=120,
               what=f"torch {version}: uv pip install {wheel.name}")
    times.append((f"torch {version}: install the wheel", t))
    listed, _ = run([uv, "pip", "freeze", "--python", python], env=env, cwd=work, timeout=60,
                    what=f"torch {version}: uv pip freeze")
    names = {re.split(r"[=@ ]", line, maxsplit=1)[0].lower() for line in listed.splitlines() if line.strip()}
    if f"torch=={version}" not in listed or "fsdp-odc" not in names:
        raise Failure(f"torch {version}: the venv holds {sorted(names)}, without torch {version} or fsdp-odc")

    env["VIRTUAL_ENV"] = str(venv)
    ranks = ranks_of(command)
    norms = {}
    for variant, script in scripts.items():
        scratch = venv / f"quickstart-{variant}"
        scratch.mkdir()
        (scratch / "train.py").write_text(script, encoding="utf-8")
        what = f"torch {version}: quickstart ({'as written' if variant == 'gloo' else 'with the backend block'})"
        out, t = run(["bash", "-c", command], env=env, cwd=scratch, timeout=600, what=what)
        times.append((what, t))
        (scratch / "output.txt").write_text(out, encoding="utf-8")
        norms[variant] = steps_of(out, ranks, what)
        print(f"[wheel-test] {what}: ok, {ranks} ranks x {len(norms[variant])} steps, grad norms "
              f"{', '.join(f'{n:g}' for n in norms[variant])} ({t:.1f} s)", flush=True)
    if len(norms["gloo"]) != len(norms["odc"]) or any(
            abs(a - b) > NORM_TOLERANCE for a, b in zip(norms["gloo"], norms["odc"], strict=True)):
        raise Failure(f"torch {version}: the backend run's grad norms {norms['odc']} are not the gloo run's "
                      f"{norms['gloo']} (within {NORM_TOLERANCE:g}): the quickstart's seeded model and data train "
                      f"alike whichever backend carries the process group's collectives")


def leg_env(venv: Path, uv: str) -> dict[str, str]:
    """What the user's shell would have: the venv's bin first (as an activated venv has it), the system's
    folders, no Rust toolchain, nothing of this checkout's environment but the network settings installs need."""
    path = f"{venv}/bin:/usr/bin:/bin"
    for tool in ("cargo", "rustc"):
        if shutil.which(tool, path=path):
            raise Failure(f"{tool} is on the test's PATH ({shutil.which(tool, path=path)}); the wheel must install "
                          f"and run without a Rust toolchain")
    cache = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, check=True).stdout.strip()
    env = {"PATH": path, "HOME": str(venv / "home"), "LANG": "C.UTF-8"}
    env.update({k: v for k, v in os.environ.items() if k.startswith(("UV_", "PIP_", "SSL_CERT_"))
                or k.endswith("CA_BUNDLE") or k.lower() in ("https_proxy", "http_proxy", "no_proxy", "all_proxy")})
    env["UV_CACHE_DIR"] = cache
    return env


def hf_leg(wheel: Path, blocks: dict[str, str], work: Path, uv: str, times: list[tuple[str, float]]) -> None:
    """docs/trainers.md's SFTTrainer script with its accelerate launch command, in a venv of the wheel and its hf
    extra only."""
    venv = work / "hf"
    shutil.rmtree(venv, ignore_errors=True)
    env = leg_env(venv, uv)
    python = str(venv / "bin" / "python")
    _, t = run([uv, "venv", "-q", "--python", "python3", str(venv)], env=env, cwd=work, timeout=120,
               what="hf: uv venv")
    times.append(("hf: uv venv", t))
    (venv / "home").mkdir()
    _, t = run([uv, "pip", "install", "-q", "--no-build", "--python", python, f"fsdp-odc[hf] @ {wheel.as_uri()}"],
               env=env, cwd=work, timeout=900, what=f"hf: uv pip install fsdp-odc[hf] @ {wheel.name}")
    times.append(("hf: install the wheel with its hf extra", t))
    listed, _ = run([uv, "pip", "freeze", "--python", python], env=env, cwd=work, timeout=60, what="hf: uv pip freeze")
    for pin in ("trl==1.16.0", "accelerate==1.15.0"):
        if pin not in listed.splitlines():
            raise Failure(f"hf: the venv holds no {pin} (fsdp-odc[hf]'s pin):\n{listed}")
    env["VIRTUAL_ENV"] = str(venv)
    scratch = venv / "docs-hf"
    scratch.mkdir()
    for name, text in blocks.items():
        if name != "run":
            (scratch / name).write_text(text, encoding="utf-8")
    what = "hf: docs/trainers.md's SFTTrainer script, its accelerate launch command as written"
    out, t = run(["bash", "-c", blocks["run"]], env=env, cwd=scratch, timeout=900, what=what)
    times.append((what, t))
    (scratch / "output.txt").write_text(out, encoding="utf-8")
    steps = re.search(r"max_steps=(\d+)", blocks["train_sft.py"])
    if steps is None:
        raise Failure("hf: the docs' train_sft.py sets no max_steps=N (the steps its log must show)")
    losses = [float(v) for v in HF_STEP.findall(out)]
    if len(losses) != int(steps.group(1)) or not all(math.isfinite(v) for v in losses) or "'train_loss'" not in out:
        raise Failure(f"hf: {what}: {len(losses)} step losses {losses} (want {steps.group(1)}, finite) and a "
                      f"train_loss; its output:\n{out}")
    print(f"[wheel-test] {what}: ok, losses {', '.join(f'{v:g}' for v in losses)} ({t:.1f} s)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheels", default="dist", help="the folder holding the one fsdp_odc-*.whl (default dist)")
    p.add_argument("--torch", default="2.11.0,2.15.0", help="torch versions, comma-separated (default 2.11.0,2.15.0)")
    p.add_argument("--work", default="target/wheel-test", help="where the venvs go (default target/wheel-test)")
    p.add_argument("--readme", default="README.md", help="where the quickstart is read (default README.md)")
    p.add_argument("--docs", default="docs/trainers.md", help="where the Hugging Face blocks are read")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face leg")
    args = p.parse_args()
    times: list[tuple[str, float]] = []
    t0 = time.monotonic()
    try:
        blocks = quickstart(ROOT / args.readme)
        ranks_of(blocks["run"])
        scripts = {"gloo": blocks["train.py"], "odc": with_backend(blocks["train.py"], blocks["backend"])}
        wheel = the_wheel(ROOT / args.wheels).resolve()
        uv = find_uv()
        work = (ROOT / args.work).resolve()
        work.mkdir(parents=True, exist_ok=True)
        print(f"[wheel-test] {wheel.name}; README.md's quickstart: train.py ({len(blocks['train.py'].splitlines())} "
              f"lines), run: {blocks['run'].strip()}; the backend block replaces train.py's {GLOO_LINE} line in "
              f"the second run", flush=True)
        hf = None if args.no_hf else marked_blocks(ROOT / args.docs, "hf", HF_BLOCKS)
        for version in filter(None, (v.strip() for v in args.torch.split(","))):  # --torch '': the hf leg alone
            leg(version, wheel, blocks["run"], scripts, work, uv, times)
        if hf is not None:
            hf_leg(wheel, hf, work, uv, times)
    except Failure as e:
        print(f"[wheel-test] FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        for what, t in times:
            print(f"[wheel-test] {t:6.1f} s  {what}")
    print(f"[wheel-test] ok: the quickstart{'' if args.no_hf else ' and the Hugging Face script'} ran as written in "
          f"fresh venvs ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
