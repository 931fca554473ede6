"""Render Triton model repositories from the templates under model_repo/.

A profile is a folder of model_repo/ (local, trtllm, clip_trt, llmapi). A templated profile
has a params.toml declaring its parameters; every `${name}` in its config.pbtxt and
1/*.yaml files must be one of them (or derived from them, see DERIVED). Values come from a
TOML settings file (one table per profile) and `--set profile.name=value`; unknown and
missing keys are refused. The rendered repository is checked before it is put in place:
every config.pbtxt parses as a Triton ModelConfig, every ensemble step names a model of the
repository with inputs, outputs and data types that fit, and every LLM-API model.yaml has
the keys TensorRT-LLM's llmapi model.py reads. For trtllm, the engine's config.json is
checked against the settings.

trtllm and llmapi are the two ways TensorRT-LLM runs on Triton: trtllm a prebuilt TensorRT
engine behind the tensorrtllm backend (token ids; what older deployments run), llmapi the
LLM API on its PyTorch backend (text; no engine to build). See docs/deployment.md.
"""

from __future__ import annotations

import json
import shutil
import string
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from gateway.deploy import MODEL_REPO, ToolError

PROFILES = ("local", "trtllm", "clip_trt", "llmapi")
# Template values computed from a profile's parameters, not set by the user.
DERIVED = {"llmapi": ("cuda_graph_config",)}
# The files of TensorRT-LLM's llmapi model that render copies in (--llmapi-source).
LLMAPI_CODE = ("model.py", "helpers.py")
_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
_REQUIRED = object()


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: Any = _REQUIRED
    choices: tuple[Any, ...] = ()
    min: float | None = None
    max: float | None = None
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def coerce(self, value: Any, where: str) -> Any:
        """A TOML value, or the text of a --set, as this parameter's type, checked."""
        if isinstance(value, str) and self.type != "str":
            value = _parse_text(value, self.type, f"{where}: {self.name}")
        expected = _TYPES[self.type]
        # TOML ints are fine where a float is expected; bools are not ints here.
        if self.type == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ToolError(f"{where}: {self.name} must be {self.type}, got {value!r}")
        if self.choices and value not in self.choices:
            raise ToolError(f"{where}: {self.name} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        if isinstance(value, int | float) and self.min is not None and value < self.min:
            raise ToolError(f"{where}: {self.name} must be >= {self.min}, got {value!r}")
        if isinstance(value, int | float) and self.max is not None and value > self.max:
            raise ToolError(f"{where}: {self.name} must be <= {self.max}, got {value!r}")
        if isinstance(value, str) and ("\n" in value or not value.strip()):
            raise ToolError(f"{where}: {self.name} must be a non-empty single line")
        return value


def _parse_text(text: str, type_name: str, where: str) -> Any:
    try:
        if type_name == "int":
            return int(text)
        if type_name == "float":
            return float(text)
        if type_name == "bool" and text.lower() in ("true", "false"):
            return text.lower() == "true"
    except ValueError:
        pass
    raise ToolError(f"{where} must be {type_name}, got {text!r}")


def format_value(value: Any) -> str:
    """A value as it goes into a config.pbtxt: pbtxt booleans, and strings escaped for a
    quoted string literal (harmless where the placeholder is unquoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value.replace("\\", "\\\\").replace('"', '\\"')
    return str(value)


@dataclass(frozen=True)
class Profile:
    name: str
    root: Path
    params: dict[str, Param] = field(default_factory=dict)

    @property
    def templated(self) -> bool:
        return (self.root / "params.toml").exists()

    @classmethod
    def load(cls, name: str, base: Path = MODEL_REPO) -> Profile:
        root = base / name
        if name not in PROFILES or not root.is_dir():
            raise ToolError(f"unknown profile {name!r}; profiles: {', '.join(PROFILES)}")
        params: dict[str, Param] = {}
        params_file = root / "params.toml"
        if params_file.exists():
            for key, spec in tomllib.loads(params_file.read_text()).items():
                params[key] = Param(
                    name=key,
                    type=spec["type"],
                    default=spec.get("default", _REQUIRED),
                    choices=tuple(spec.get("choices", ())),
                    min=spec.get("min"),
                    max=spec.get("max"),
                    help=spec.get("help", ""),
                )
        return cls(name=name, root=root, params=params)

    def templates(self) -> list[Path]:
        return sorted([*self.root.glob("*/config.pbtxt"), *self.root.glob("*/1/*.yaml")])

    def placeholders(self) -> set[str]:
        names: set[str] = set()
        for path in self.templates():
            names |= set(string.Template(path.read_text()).get_identifiers())
        return names

    def resolve(self, given: dict[str, Any]) -> dict[str, Any]:
        """Settings for this profile, checked and completed with defaults."""
        where = f"[{self.name}]"
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            raise ToolError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(self.params))}")
        missing = sorted(name for name, p in self.params.items() if p.required and name not in given)
        if missing:
            raise ToolError(f"{where}: missing required key(s) {', '.join(missing)}")
        values = {name: p.default for name, p in self.params.items() if not p.required}
        for name, value in given.items():
            values[name] = self.params[name].coerce(value, where)
        return values


def derived(profile: str, values: dict[str, Any]) -> dict[str, Any]:
    """The DERIVED template values of a profile."""
    if profile == "llmapi":
        # The LLM API's CudaGraphConfig: graphs for every batch up to max_batch_size (a batch
        # is padded to the next captured size); null turns them off.
        graphs = f"{{enable_padding: true, max_batch_size: {values['max_batch_size']}}}"
        return {"cuda_graph_config": graphs if values["cuda_graphs"] else "null"}
    return {}


def load_settings(path: Path | None) -> dict[str, dict[str, Any]]:
    if path is None:
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ToolError(f"settings file {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ToolError(f"settings file {path}: {exc}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ToolError(f"settings file {path}: {section!r} must be a [profile] table")
    return data


def parse_sets(items: list[str]) -> dict[str, dict[str, str]]:
    """`profile.key=value` strings as {profile: {key: value}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        target, sep, value = item.partition("=")
        profile, dot, key = target.partition(".")
        if not sep or not dot or not profile or not key:
            raise ToolError(f"--set {item!r}: expected profile.key=value, e.g. trtllm.engine_dir=/engines/gpt2")
        out.setdefault(profile, {})[key] = value
    return out


# ---- validation of a rendered repository --------------------------------------------


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(path.read_text(), config)
    except text_format.ParseError as exc:
        raise ToolError(f"{path}: not a valid Triton model config: {exc}") from None
    return config


def load_repo(repo: Path) -> dict[str, model_config_pb2.ModelConfig]:
    configs: dict[str, model_config_pb2.ModelConfig] = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        config = parse_config(path)
        if config.name != path.parent.name:
            raise ToolError(f"{path}: name {config.name!r} differs from its folder {path.parent.name!r}")
        configs[config.name] = config
    return configs


def check_repo(repo: Path) -> dict[str, model_config_pb2.ModelConfig]:
    """Every config parses; every ensemble step fits the model it names; every LLM-API
    model.yaml has what model.py reads."""
    configs = load_repo(repo)
    if not configs:
        raise ToolError(f"{repo}: no config.pbtxt found")
    for name, config in configs.items():
        if not (repo / name / "1").is_dir():
            raise ToolError(f"{repo / name}: version folder 1/ missing")
        if config.platform == "ensemble":
            _check_ensemble(config, configs)
        if (repo / name / "1" / "model.yaml").exists():
            check_llmapi_yaml(repo / name / "1" / "model.yaml", config)
    return configs


def check_llmapi_yaml(path: Path, config: model_config_pb2.ModelConfig) -> dict[str, Any]:
    """TensorRT-LLM's llmapi model.yaml: the LLM API's arguments, and triton_config, which
    model.py's auto_complete_config applies; config.pbtxt, where it sets the same fields
    (for a Triton without auto-complete), must agree with it."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ToolError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(document, dict):
        raise ToolError(f"{path}: expected a mapping of LLM API arguments")
    missing = [key for key in ("model", "backend", "triton_config") if not document.get(key)]
    triton = document.get("triton_config") or {}
    missing += [f"triton_config.{key}" for key in ("max_batch_size", "decoupled") if key not in triton]
    if missing:
        raise ToolError(f"{path}: missing {', '.join(missing)}")
    config_path = path.parent.parent / "config.pbtxt"
    if config.max_batch_size != triton["max_batch_size"]:
        raise ToolError(
            f"{config_path}: max_batch_size {config.max_batch_size} differs from model.yaml's "
            f"triton_config.max_batch_size {triton['max_batch_size']}"
        )
    if config.HasField("model_transaction_policy") and config.model_transaction_policy.decoupled != bool(
        triton["decoupled"]
    ):
        raise ToolError(f"{config_path}: decoupled differs from model.yaml's triton_config.decoupled")
    return document


def _check_ensemble(ensemble: model_config_pb2.ModelConfig, configs: dict[str, Any]) -> None:
    where = f"ensemble {ensemble.name}"
    dtypes = {t.name: t.data_type for t in ensemble.input}
    optional = {t.name for t in ensemble.input if t.optional}
    for step in ensemble.ensemble_scheduling.step:
        model = configs.get(step.model_name)
        if model is None:
            raise ToolError(f"{where}: step model {step.model_name!r} is not in the repository")
        inputs = {t.name: t for t in model.input}
        outputs = {t.name: t for t in model.output}
        for key, tensor in step.input_map.items():
            if key not in inputs:
                raise ToolError(f"{where}: {step.model_name} has no input {key!r}")
            if tensor not in dtypes:
                raise ToolError(
                    f"{where}: tensor {tensor!r} (to {step.model_name}.{key}) is produced by no earlier step"
                )
            if dtypes[tensor] != inputs[key].data_type:
                raise ToolError(f"{where}: {tensor!r} has a different data type than {step.model_name}.{key}")
            if tensor in optional and not inputs[key].optional:
                raise ToolError(f"{where}: optional {tensor!r} feeds required input {step.model_name}.{key}")
        unmapped = sorted(n for n, t in inputs.items() if not t.optional and n not in step.input_map)
        if unmapped:
            raise ToolError(f"{where}: required input(s) of {step.model_name} not mapped: {', '.join(unmapped)}")
        for key, tensor in step.output_map.items():
            if key not in outputs:
                raise ToolError(f"{where}: {step.model_name} has no output {key!r}")
            dtypes[tensor] = outputs[key].data_type
    for output in ensemble.output:
        if dtypes.get(output.name) != output.data_type:
            raise ToolError(f"{where}: output {output.name!r} is not produced with its data type by any step")


# ---- engine checks --------------------------------------------------------------------


def check_trtllm_engine(config_json: Path, values: dict[str, Any]) -> None:
    """The engine's build settings must hold what the repository will ask of it."""
    try:
        engine = json.loads(config_json.read_text())
        build = engine["build_config"]
        mapping = engine["pretrained_config"].get("mapping", {})
        tp_size = int(mapping.get("tp_size", 1))
        pp_size = int(mapping.get("pp_size", 1))
        engine_batch = int(build["max_batch_size"])
        engine_input = int(build["max_input_len"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ToolError(f"{config_json}: not a TensorRT-LLM engine config ({exc})") from None
    problems = []
    if values["triton_max_batch_size"] > engine_batch:
        problems.append(
            f"triton_max_batch_size={values['triton_max_batch_size']} > engine max_batch_size={engine_batch}"
        )
    if values["max_input_len"] > engine_input:
        problems.append(f"max_input_len={values['max_input_len']} > engine max_input_len={engine_input}")
    if values["tensor_parallel_size"] != tp_size:
        problems.append(f"tensor_parallel_size={values['tensor_parallel_size']} but the engine has tp_size={tp_size}")
    missing = [
        f"rank{r}.engine" for r in range(tp_size * pp_size) if not (config_json.parent / f"rank{r}.engine").exists()
    ]
    if missing:
        problems.append(f"engine file(s) missing: {', '.join(missing)}")
    if problems:
        raise ToolError(f"engine {config_json.parent} does not fit the settings: {'; '.join(problems)}")


# ---- rendering ------------------------------------------------------------------------


@dataclass
class RenderResult:
    out: Path
    models: list[str]
    notes: list[str]


def render_profile(profile: Profile, values: dict[str, Any], dest: Path) -> list[str]:
    """Copy the profile's models into dest, with its templates (config.pbtxt, 1/*.yaml)
    filled in."""
    formatted = {name: format_value(value) for name, value in {**values, **derived(profile.name, values)}.items()}
    models = []
    for model_dir in sorted(p for p in profile.root.iterdir() if (p / "config.pbtxt").exists()):
        target = dest / model_dir.name
        if target.exists():
            raise ToolError(f"model {model_dir.name!r} comes from two profiles; render them into separate repositories")
        shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        if profile.templated:
            for template in [model_dir / "config.pbtxt", *sorted(model_dir.glob("1/*.yaml"))]:
                try:
                    rendered = string.Template(template.read_text()).substitute(formatted)
                except (KeyError, ValueError) as exc:
                    raise ToolError(f"{template}: template parameter {exc} is not declared in params.toml") from None
                (target / template.relative_to(model_dir)).write_text(rendered)
        (target / "1").mkdir(exist_ok=True)
        models.append(model_dir.name)
    return models


def copy_llmapi_code(source: Path, dest: Path) -> str:
    """TensorRT-LLM's llmapi model.py and helpers.py (from the serving container's version)
    into the rendered tensorrt_llm/1/."""
    missing = [name for name in LLMAPI_CODE if not (source / name).is_file()]
    if missing:
        raise ToolError(
            f"--llmapi-source {source}: no {', '.join(missing)} there (TensorRT-LLM's "
            "triton_backend/all_models/llmapi/tensorrt_llm/1)"
        )
    for name in LLMAPI_CODE:
        shutil.copy2(source / name, dest / "tensorrt_llm" / "1" / name)
    return f"copied {', '.join(LLMAPI_CODE)} from {source}"


def _replaceable(out: Path) -> bool:
    """Only an earlier render (folders with a config.pbtxt each) may be replaced."""
    return all(p.is_dir() and (p / "config.pbtxt").exists() for p in out.iterdir())


def render(
    profiles: list[str],
    out: Path,
    settings: dict[str, dict[str, Any]] | None = None,
    sets: dict[str, dict[str, str]] | None = None,
    engine_dir: Path | None = None,
    force: bool = False,
    base: Path = MODEL_REPO,
    llmapi_source: Path | None = None,
) -> RenderResult:
    settings = settings or {}
    sets = sets or {}
    if not profiles:
        profiles = [name for name in PROFILES if name in settings] or []
    if not profiles:
        raise ToolError(f"no profile to render: pass --profile ({', '.join(PROFILES)}) or give a settings table")
    loaded = [Profile.load(name, base) for name in dict.fromkeys(profiles)]
    stray = sorted((set(settings) | set(sets)) - {p.name for p in loaded})
    if stray:
        raise ToolError(f"settings for profile(s) not being rendered: {', '.join(stray)}")
    if llmapi_source is not None and "llmapi" not in {p.name for p in loaded}:
        raise ToolError("--llmapi-source is for the llmapi profile, which is not being rendered")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ToolError(f"{out} is not empty; pass --force to replace an earlier render")
        if not _replaceable(out):
            raise ToolError(f"{out} holds files other than a model repository; refusing to replace it")

    notes: list[str] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        models: list[str] = []
        for profile in loaded:
            values = profile.resolve({**settings.get(profile.name, {}), **sets.get(profile.name, {})})
            models += render_profile(profile, values, staging)
            if profile.name == "trtllm":
                notes.append(_check_engine_if_present(values, engine_dir))
            if profile.name == "llmapi":
                notes.append(
                    copy_llmapi_code(llmapi_source, staging)
                    if llmapi_source is not None
                    else f"tensorrt_llm/1 still needs {' and '.join(LLMAPI_CODE)} from the container's TensorRT-LLM "
                    "(triton_backend/all_models/llmapi/tensorrt_llm/1): pass --llmapi-source"
                )
        check_repo(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return RenderResult(out=out, models=models, notes=notes)


def _check_engine_if_present(values: dict[str, Any], engine_dir: Path | None) -> str:
    # engine_dir in the settings is the path inside the Triton container; --engine-dir
    # names the same folder as this machine sees it, and then it must be there.
    candidate = engine_dir if engine_dir is not None else Path(values["engine_dir"])
    config_json = candidate / "config.json"
    if not config_json.exists():
        if engine_dir is not None:
            raise ToolError(f"--engine-dir {engine_dir}: no config.json there")
        return f"engine not checked: {config_json} is not on this machine (pass --engine-dir to check it)"
    check_trtllm_engine(config_json, values)
    return f"engine {candidate} fits the settings"
