"""Checkpoints: a Hugging Face model folder plus trainer state, written atomically.

Layout: OUTPUT/checkpoints/step_00000100/{config.json, model.safetensors, tokenizer...,
trainer_state.pt}. Everything is written into a hidden temporary folder next to it and
renamed into place, so a folder named step_* is always complete; a run killed mid-save
leaves only a .tmp-* folder, which the next save or resume removes.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from flywheel.files import fsync_dir
from flywheel.models.loading import quiet_transformers

STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_model_folder(model, tokenizer, dest: Path) -> None:
    """Write a loadable HF folder to `dest` atomically (temporary name, then rename)."""
    quiet_transformers()
    dest = Path(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _fsync_files(tmp)
    _replace_dir(tmp, dest)


def save_checkpoint(root: Path, step: int, model, tokenizer, state: dict, keep: int) -> Path:
    """Write checkpoint `step` under root/checkpoints and prune to the newest `keep`."""
    ckpt_root = Path(root) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    quiet_transformers()
    dest = ckpt_root / f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-{dest.name}-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / STATE_FILE)
    _fsync_files(tmp)
    _replace_dir(tmp, dest)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root/checkpoints, oldest first."""
    ckpt_root = Path(root) / "checkpoints"
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / STATE_FILE, map_location="cpu", weights_only=False)


def _replace_dir(tmp: Path, dest: Path) -> None:
    if dest.exists():  # rename cannot replace a non-empty folder; move the old one aside first
        old = dest.parent / f".tmp-old-{dest.name}-{os.getpid()}"
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dest)
    fsync_dir(dest.parent)


def _fsync_files(folder: Path) -> None:
    """Flush the files of `folder` to disk before it is renamed into place."""
    for f in Path(folder).iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
