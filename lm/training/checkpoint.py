"""Checkpoints that are complete or absent, whatever the strategy wrote (a file, or a directory of shards).

Every rank writes into `step=N.ckpt.tmp`; once all have finished, rank 0 records what was written, each file's size
and sha256, in a manifest (`lm-checkpoint.json` inside a directory of shards; `step=N.ckpt.lm-checkpoint.json`
beside a single file), flushes it to disk and renames the checkpoint to `step=N.ckpt`. So a checkpoint under its final
name was complete when written; `checkpoint_problem` checks that every byte is still what was written before a resume,
an export or an evaluation uses it. The writing is lm.training.step_checkpoint's: this module, which the readers
import, does not import Lightning.
"""

import json
import re
import sys
import zipfile
import zlib
from pathlib import Path

from lm.data_prep.shards import sha256_file
from lm.training.data_only import require_data_only
from lm.util.errors import UserError

STEP_NAME = re.compile(r"^step=(\d+)\.ckpt$")
CONTENTS = "lm-checkpoint.json"


def manifest_of(path: Path) -> Path:
    """Where the manifest of the checkpoint at `path` is (or goes): inside a directory, beside a file."""
    return path / CONTENTS if path.is_dir() else path.with_name(f"{path.name}.{CONTENTS}")


def write_manifest(checkpoint: Path, manifest: Path) -> None:
    """Size and sha256 of every file of `checkpoint` (a file: one entry, named "")."""
    files = [checkpoint] if checkpoint.is_file() else sorted(p for p in checkpoint.rglob("*") if p.is_file())
    entries = {("" if f == checkpoint else str(f.relative_to(checkpoint))): {"size": f.stat().st_size,
                                                                             "sha256": sha256_file(f)} for f in files}
    manifest.write_text(json.dumps({"files": entries}, indent=1))


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint at `path` cannot be used (None if it is whole): every file its manifest lists must be
    there with the recorded size and sha256. A file without a manifest (written before lm kept them) must be a
    readable torch zip whose every member matches the CRC-32 torch's writer recorded for it (torch.load itself does
    not check them: a flipped byte in a tensor would load as another number); a directory without one is
    incomplete."""
    path = Path(path)
    if not path.exists():
        return f"{path} not found"
    manifest = manifest_of(path)
    if path.is_file() and not manifest.is_file():
        try:
            with zipfile.ZipFile(path) as archive:
                damaged = archive.testzip()  # reads every member and checks its CRC-32: the first bad one's name
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as err:
            return f"{path} is not a readable checkpoint ({' '.join(str(err).split())})"
        if damaged is not None:
            return f"{path} is damaged ({damaged} does not match the CRC-32 written with it)"
        return None
    if not manifest.is_file():
        return f"{path} is incomplete (no {CONTENTS})"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as err:
        return f"{manifest} is unreadable ({err})"
    for name, recorded in files.items():
        file = path / name if name else path
        size, sha256 = (recorded, None) if isinstance(recorded, int) else (recorded["size"], recorded["sha256"])
        if not file.is_file():
            return f"{path} is missing {name}"
        if file.stat().st_size != size:
            return f"{path}: {name or 'the file'} has {file.stat().st_size} bytes, {size} were written"
        if sha256 is not None and sha256_file(file) != sha256:
            return f"{path}: {name or 'the file'} is damaged (its sha256 is not the one written)"
    return None


def step_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoints `step=N.ckpt` in `directory`, newest first (temporary ones are ignored)."""
    found = [(int(m.group(1)), p) for p in Path(directory).glob("step=*.ckpt") if (m := STEP_NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def newest_checkpoint(directory: str | Path, warn: bool = True) -> Path | None:
    """The newest usable checkpoint in `directory`; damaged newer ones are skipped with a warning on stderr."""
    for path in step_checkpoints(directory):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if warn:
            print(f"lm: warning: skipping checkpoint {problem}", file=sys.stderr)
    return None


def require_usable(path: str | Path) -> Path:
    """`path` if it is a usable checkpoint, else a UserError saying why."""
    problem = checkpoint_problem(path)
    if problem:
        raise UserError(f"checkpoint {problem}")
    return Path(path)


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory holding a checkpoint (run_dir/checkpoints/step=N.ckpt) or the directory itself."""
    path = Path(checkpoint)
    if path.is_dir() and not STEP_NAME.match(path.name):
        return path
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint path, or a run directory's newest checkpoint; whole, and holding nothing but data
    (lm.training.data_only), checked before the caller reads or writes anything."""
    found = _whole_checkpoint(path)
    require_data_only(found)
    return found


def _whole_checkpoint(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir() and not STEP_NAME.match(path.name) and not (path / CONTENTS).exists():
        found = newest_checkpoint(path / "checkpoints") or newest_checkpoint(path)
        if found is None:
            raise UserError(f"no checkpoint in {path}")
        return found
    if not path.exists():
        raise UserError(f"checkpoint {path} not found")
    return require_usable(path)


def load_model(path: str | Path, map_location: str = "cpu"):
    """(LanguageModel in eval mode, hyperparameters) from a checkpoint of any strategy, or a run directory."""
    from lm.model import LanguageModel, LMConfig
    from lm.training.consolidate import consolidate

    state_dict, hparams = consolidate(resolve_checkpoint(path))
    model = LanguageModel(LMConfig(**hparams["model"]))
    model.load_state_dict(state_dict)
    return model.to(map_location).eval(), hparams


def tokenizer_path(checkpoint: str | Path) -> Path:
    """tokenizer.json of an `lm export` directory (either format), or of the run a checkpoint (or run directory)
    belongs to."""
    path = Path(checkpoint)
    if not path.exists():
        raise UserError(f"checkpoint {checkpoint} not found")
    exported = (path / "model.safetensors").is_file() or (path / "config.json").is_file()
    tokenizer = path / "tokenizer.json" if exported else run_dir_of(checkpoint) / "tokenizer.json"
    if not tokenizer.is_file():
        raise UserError(f"no tokenizer.json beside the checkpoint (looked for {tokenizer})")
    return tokenizer


def load_with_tokenizer(checkpoint: str | Path):
    """(LanguageModel in eval mode, tokenizers.Tokenizer) from a checkpoint, a run directory or an `lm export`
    directory of either format."""
    from tokenizers import Tokenizer

    from lm.model import LanguageModel

    tokenizer = Tokenizer.from_file(str(tokenizer_path(checkpoint)))
    if (Path(checkpoint) / "config.json").is_file():
        return LanguageModel.from_pretrained(str(checkpoint)), tokenizer
    return load_model(checkpoint)[0], tokenizer
