"""The Dockerfile read as the image builder reads it: stages, their instructions, ENV and CMD (for the tests that run
the image's command in the project's venv, and check the images' shape)."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from servers import ROOT

DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def all(self, instruction: str) -> list[str]:
        return [args for inst, args in self.instructions if inst == instruction]

    def last(self, instruction: str) -> str | None:
        found = self.all(instruction)
        return found[-1] if found else None


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#"):  # also inside a continued instruction
            continue
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            lines.append(current.strip())
        current = ""
    out = []
    for line in lines:
        inst, _, args = line.partition(" ")
        out.append((inst.upper(), args.strip()))
    return out


def stages(path: Path = DOCKERFILE) -> dict[str, Stage]:
    """The stages by name, in order; a stage's instructions include those of the stage it is built FROM."""
    found: dict[str, Stage] = {}
    current = None
    for inst, args in instructions(path.read_text()):
        if inst == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            base, name = match.group(1), match.group(2) or f"stage{len(found)}"
            inherited = list(found[base].instructions) if base in found else []
            current = found[name] = Stage(name, base, inherited)
        elif current is not None:
            current.instructions.append((inst, args))
    return found


def exec_form(args: str) -> list[str]:
    """A CMD / HEALTHCHECK CMD in exec (JSON) form."""
    return json.loads(args)


def env_of(stage: Stage) -> dict[str, str]:
    """The stage's ENV settings, in order (later ones win), with $VAR / ${VAR} of earlier ones expanded."""
    env: dict[str, str] = {}
    for args in stage.all("ENV"):
        for item in shlex.split(args):
            key, _, value = item.partition("=")
            env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), os.environ.get(m.group(1), "")), value)
    return env


def healthcheck(stage: Stage) -> list[str]:
    args = stage.last("HEALTHCHECK")
    return exec_form(args[args.index("CMD") + 3 :].strip())


def local_argv(argv: list[str]) -> list[str]:
    """The image's command as it runs in the project's venv: its `python` is this interpreter."""
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


# what the image's ENV sets that must not leak into a run on this machine: paths of the image's own layout
IMAGE_ONLY = {"PATH", "VIRTUAL_ENV", "MODEL_CACHE_DIR", "HF_HOME"}


def local_env(stage: Stage, **overrides: str) -> dict[str, str]:
    """This machine's environment (less JWT_SECRET) with the image's settings on top, then the test's."""
    env = {k: v for k, v in os.environ.items() if k != "JWT_SECRET"}
    env.update({k: v for k, v in env_of(stage).items() if k not in IMAGE_ONLY})
    env.update(overrides)
    return env
