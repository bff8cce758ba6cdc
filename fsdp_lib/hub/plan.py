"""Which files of a hub model repository training needs, chosen from its listing: config, generation config and
tokenizer files, and the weights (safetensors preferred, PyTorch .bin only as a fallback, an index's shards or the
top-level weight files). Pure logic; no network, no torch."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fsdp_lib.hub.console import ToolError
from fsdp_lib.model.hf_files import BIN_INDEX, SAFETENSORS_INDEX

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",  # sentencepiece (Llama 2, Mistral, Gemma)
    "vocab.json",
    "merges.txt",  # GPT-2 style BPE
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass
class DownloadPlan:
    metadata_files: list[str]
    """config, generation config, tokenizer files and the weight index, fetched first."""
    weight_format: str  # "safetensors" or "bin"
    index_file: str | None
    """When set, the weight files are the shards named in its weight_map."""
    weight_files: list[str] = field(default_factory=list)
    """The weight files when there is no index."""


def plan_download(repo_files: Iterable[str]) -> DownloadPlan:
    """Choose what training needs from a repository listing: safetensors preferred, .bin only as a fallback.

    Only top-level files: subfolders hold other formats (e.g. Meta's own format in original/) training never reads.
    """
    top_level = sorted(name for name in set(repo_files) if "/" not in name)
    if "config.json" not in top_level:
        raise ToolError("the repository has no config.json; it is not a transformers model")
    metadata = [name for name in top_level if name in CONFIG_FILES or name in TOKENIZER_FILES]
    safetensors_files = [name for name in top_level if is_weight_file(name, "safetensors")]
    bin_files = [name for name in top_level if is_weight_file(name, "bin")]
    if SAFETENSORS_INDEX in top_level:
        return DownloadPlan(metadata + [SAFETENSORS_INDEX], "safetensors", SAFETENSORS_INDEX)
    if safetensors_files:
        return DownloadPlan(metadata, "safetensors", None, safetensors_files)
    if BIN_INDEX in top_level:
        return DownloadPlan(metadata + [BIN_INDEX], "bin", BIN_INDEX)
    if bin_files:
        return DownloadPlan(metadata, "bin", None, bin_files)
    raise ToolError(
        "the repository has no weights in safetensors or PyTorch .bin format "
        f"(top-level files: {', '.join(top_level) or 'none'})"
    )


def is_weight_file(name: str, weight_format: str) -> bool:
    """A top-level weight file of this format; not other formats' copies that some repositories ship beside the
    model (consolidated*.safetensors of Mistral's own format, adapter_model*.safetensors of PEFT)."""
    if "/" in name:
        return False
    if weight_format == "safetensors":
        return name.endswith(".safetensors") and not name.startswith(("consolidated", "adapter_model"))
    return name.startswith("pytorch_model") and name.endswith(".bin")


def glob_escape(name: str) -> str:
    """allow_patterns are fnmatch patterns: escape [, ] , * and ? so a filename matches only itself."""
    return "".join(f"[{char}]" if char in "[]*?" else char for char in name)
