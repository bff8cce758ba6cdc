"""What the bad-input tables share (tests/test_bad_inputs*.py): the folders a user already has, a case of the
table, and the check every case makes: the tool refuses with a message naming the flag (or the folder) and the fix,
a non-zero exit, no traceback, and every byte that existed before is still there afterwards."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import data_hf
import fsdp_train
import organize_data
from tests.fsdp_helpers import make_dataset

# --- the folders a user already has -------------------------------------------------------------------------------


def make_experiment(folder: Path) -> Path:
    """What fsdp_train.py leaves in outputs/EXP: a checkpoint, its state, metrics, the config and an export."""
    (folder / "checkpoint" / "step_00000002").mkdir(parents=True)
    (folder / "checkpoint" / "step_00000002" / "__0_0.distcp").write_bytes(b"\x00shard" * 64)
    (folder / "state.json").write_text(json.dumps({"latest_checkpoint": "checkpoint/step_00000002", "step": 2}))
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    (folder / "config.yaml").write_text("experiment_name: exp\n")
    (folder / "final").mkdir()
    (folder / "final" / "model.safetensors").write_bytes(b"weights" * 32)
    return folder


def make_model_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"weights" * 32)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def make_splits(folder: Path) -> Path:
    (folder / "split_00").mkdir(parents=True)
    (folder / "split_00" / "a.txt").write_text("some text\n")
    (folder / ".organize_manifest.json").write_text(json.dumps({"format": 1, "files": {}}))
    return folder


def make_raw(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("The capital of Norland is Vesk.\n\nA second paragraph of plain text.\n")
    return folder


def make_records(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def snapshot(root: Path) -> dict[str, bytes | str | None]:
    """Every path under `root` with its bytes (None for a folder, the target for a link, the file type for a pipe
    or device, which cannot be read without blocking): what must be unchanged after a refusal."""
    return {str(p.relative_to(root)): _contents(p) for p in sorted(root.rglob("*"))}


def _contents(path: Path) -> bytes | str | None:
    if path.is_symlink():
        return f"link to {os.readlink(path)}"
    if path.is_dir():
        return None
    if not path.is_file():
        return f"special file {stat.S_IFMT(path.lstat().st_mode):o}"
    return path.read_bytes()


# --- the cases ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Path], int]  # the tool's main() on argv built under the test's folder; returns the exit code
    message: tuple[str, ...]  # what the error must say (all of them)
    exit_code: int = 2
    # Paths under the root the case may create (documented handling that writes, e.g. a dataset with a counted
    # skip): they must not exist before, are left out of the comparison and are removed after the case.
    creates: tuple[str, ...] = ()


def data_hf_case(
    name: str, argv: Callable[[Path], list], *message: str, exit_code: int = 1, creates: tuple[str, ...] = ()
) -> Case:
    return Case(name, lambda root: data_hf.main([str(a) for a in argv(root)]), message, exit_code, creates)


def organize_case(
    name: str, argv: Callable[[Path], list], *message: str, exit_code: int = 2, creates: tuple[str, ...] = ()
) -> Case:
    return Case(name, lambda root: organize_data.main([str(a) for a in argv(root)]), message, exit_code, creates)


def model_download_case(
    name: str, argv: Callable[[Path], list], *message: str, exit_code: int = 1, creates: tuple[str, ...] = ()
) -> Case:
    import model_download

    return Case(name, lambda root: model_download.main([str(a) for a in argv(root)]), message, exit_code, creates)


def trainer_case(
    name: str, argv: Callable[[Path], list], *message: str, exit_code: int = 2, creates: tuple[str, ...] = ()
) -> Case:
    return Case(name, lambda root: fsdp_train.main([str(a) for a in argv(root)]), message, exit_code, creates)


def trainer_flags(root: Path, experiment: str, model: str = "model") -> list[str | Path]:
    flags = ["-e", experiment, "-d", root / "dataset", "-m", root / model, "--save-dir", root / "outputs"]
    return [*flags, "--seq-length", "64"]


def damaged_models(model: Path, root: Path) -> None:
    """Copies of a real tiny model, each damaged the way downloads and hand edits damage them."""
    for name in ("cut_weights", "bad_tokenizer", "small_vocab", "gone_weights"):
        shutil.copytree(model, root / name)
    gone = root / "gone_weights"  # verified by model_download.py, then its weights deleted or moved
    record = {"verified_by": "model_download.py", "weight_files": {"model.safetensors": 1234}}
    (gone / "model_download_verified.json").write_text(json.dumps(record))
    (gone / "model.safetensors").unlink()
    weights = root / "cut_weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a download that stopped early
    (root / "bad_tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    config = json.loads((root / "small_vocab" / "config.json").read_text())
    (root / "small_vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] - 8}))


def make_user_folders(root: Path, model: Path) -> Path:
    """One user's folders, shared by the cases of a table (each case must leave them byte-identical): raw files,
    split folders, an experiment, a dataset inside --save-dir, a model folder, damaged copies of a real model, a
    Latin-1 prompts file, records that look like chat or pairs but cannot be used, and a dataset data_hf wrote."""
    make_raw(root / "raw")
    make_splits(root / "splits")
    make_experiment(root / "outputs" / "exp")
    lost = make_experiment(root / "outputs" / "lost")  # its checkpoints deleted to free the disk
    shutil.rmtree(lost / "checkpoint")
    make_raw(root / "outputs" / "notes")  # the user's own folder where an experiment would go
    (root / "outputs" / ".token_cache" / "0123abcd").mkdir(parents=True)  # a run's token cache
    legacy = root / "outputs" / "legacy"  # another tool's run, with files named as a run's: they were replaced
    legacy.mkdir()
    (legacy / "config.yaml").write_text("model: my-old-model\nlr: 1e-4\n")
    (legacy / "metrics.jsonl").write_text('{"step": 100, "loss": 1.23}\n')
    (root / "outputs" / "summary").write_text("a file where an experiment folder would go\n")
    make_dataset(root / "outputs" / "corpus", validation=False, n_docs=8)
    make_model_folder(root / "model")
    damaged_models(model, root)
    (root / "latin1_prompts.txt").write_bytes("The capital of caf\u00e9 is".encode("latin-1") + b"\n")
    wizard = [{"role": "wizard", "content": "see https://example.com"}, {"role": "assistant", "content": "ok"}]
    make_records(root / "bad_chat", [{"messages": wizard}] * 4)
    make_records(root / "same_pairs", [{"prompt": f"q{i}", "chosen": "same", "rejected": "same"} for i in range(4)])
    assert data_hf.main(["--data_folder", str(root / "raw"), "--save_dir", str(root / "dataset")]) == 0
    return root


def check_refused(case: Case, root: Path, capsys) -> None:
    """Run one case: the exit code and every part of the message, no traceback, nothing under `root` changed but
    the paths the case may create (which are removed afterwards, so the next case meets the same folders)."""
    assert not any((root / path).exists() for path in case.creates), f"{case.name}: an output exists before the case"
    before = snapshot(root)
    try:
        code = case.run(root)
        out = capsys.readouterr()
        said = out.out + out.err
        assert code == case.exit_code, said
        for part in case.message:
            assert part in said, f"{case.name}: {part!r} not in {said!r}"
        assert "Traceback" not in said
        after = {path: data for path, data in snapshot(root).items() if not _under(path, case.creates)}
        assert after == before, f"{case.name}: existing data changed"
    finally:
        for path in case.creates:
            target = root / path
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == top or path.startswith(top.rstrip("/") + "/") for top in roots)
