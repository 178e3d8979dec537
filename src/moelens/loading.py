"""`load`: a checkpoint (a local folder, a hub id, or ``"tiny"``) loaded with its tokenizer and wrapped.

The model class is the one the checkpoint was saved from; a checkpoint that does not fit its
config (missing or unexpected weights, other shapes, a damaged weights file, no weights at all)
is refused or warned about with what is wrong and what to do.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .errors import MoelensError, sentence, warn
from .model import MoeNNsight, MoeTransformersModel, refuse_lazy_loading, wrap
from .paths import user_path


#: ``from_pretrained`` settings that say where and how to read a checkpoint: moelens passes them to the
#: config and tokenizer loaders too, not only to the model's.
SOURCE_SETTINGS = ("trust_remote_code", "subfolder", "revision", "token", "cache_dir", "local_files_only")


def _check_local_folder(given: str | os.PathLike, subfolder: str, checkpoint: Checkpoint) -> None:
    """Refuse a local path that holds no checkpoint: missing, or a folder without config.json, or files of
    ``checkpoint`` (the folder and subfolder) that cannot be read (`_refuse_unreadable`). A name that
    may be a hub id (``name`` or ``namespace/name``, no local folder of that name) is left to transformers;
    ``given`` is what the user passed (``./name`` is local, though ``Path`` turns it into ``name``)."""
    text = os.fspath(given)
    path = user_path(text)
    # a hub id is `name` or `namespace/name`: a path whose first folder exists here is a local one (a typo's)
    looks_local = (path.is_absolute() or text.startswith((".", "~")) or len(path.parts) > 2
                   or (len(path.parts) == 2 and Path(path.parts[0]).is_dir()))
    source = str(path)
    if path.is_symlink() and not path.exists():  # not a hub id: transformers would go to the network for it
        raise MoelensError(f"no model at {text!r}: it is a symbolic link to a missing path ({os.readlink(path)!r}). "
                           "Pass a local checkpoint folder (holding config.json and the weights), or 'tiny'.")
    if not path.exists():
        if looks_local:
            raise MoelensError(f"no model at {text!r}: the path does not exist. Pass a local checkpoint folder "
                               "(holding config.json and the weights), or 'tiny'.")
        return
    folder = path / subfolder
    if path.is_dir():
        _refuse_unreadable(checkpoint)
    if path.is_dir() and not (folder / "config.json").is_file():
        where = f"{str(folder)!r} (subfolder {subfolder!r})" if subfolder else repr(source)
        remedy = _hides_tiny(text) or "pass one, or 'tiny'"
        held = "its config.json is a folder" if (folder / "config.json").is_dir() else "no config.json in it"
        raise MoelensError(f"{where} is not a transformers checkpoint folder ({held}); {remedy}.")


def _refuse_unreadable(checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint folder, or its config.json or the weights files the loader reads (`Checkpoint.weights_read`),
    that this user may not read (the loader said "No such file" of a weights file, or advised updating transformers
    for a config.json), or that is a symbolic link to a missing file (a hub cache whose blob was deleted)."""
    folder = checkpoint.folder
    if not folder.is_dir():  # a subfolder that is not there: named by the caller
        return
    if not os.access(folder, os.R_OK | os.X_OK):
        unreadable = [folder]
    else:
        dangling = checkpoint.missing_links()
        if dangling:
            raise MoelensError(
                f"{', '.join(f'{str(file)!r} (to {os.readlink(file)!r})' for file in dangling)} "
                f"{'is a symbolic link' if len(dangling) == 1 else 'are symbolic links'} to a missing file (a hub "
                "cache whose blobs were deleted?): download or copy the checkpoint again."
            )
        read = checkpoint.weights_read  # where the config names no file name: every weights file
        weights = read if read is not None else [*folder.glob("*.safetensors"), *folder.glob("*.bin")]
        files = [folder / "config.json", *weights]
        unreadable = [file for file in files if file.is_file() and not os.access(file, os.R_OK)]
    if unreadable:
        raise MoelensError(f"this user may not read {', '.join(repr(str(path)) for path in unreadable)} (permission "
                           "denied): give read access (chmod +r), or load the checkpoint as a user who may read it.")


#: The weights files transformers reads from a checkpoint folder, in its order of preference (safetensors first),
#: and their shard indexes.
WEIGHTS_FILES = (("model.safetensors", "model.safetensors.index.json"),
                 ("pytorch_model.bin", "pytorch_model.bin.index.json"))


@dataclass(frozen=True)
class Checkpoint:
    """A local checkpoint folder and what ``from_pretrained`` is asked of it that decides which weights files it
    reads (``variant``, ``use_safetensors``)."""

    folder: Path
    variant: str | None = None
    use_safetensors: bool | None = None

    @cached_property
    def weights_read(self) -> list[Path] | None:
        """The weights files the loader reads, as transformers picks them: the file the config names
        (``transformers_weights``), else the variant's ``model.safetensors``, else its shard index and the shards it
        lists, else the same of ``pytorch_model.bin`` (``use_safetensors`` takes one kind only; files beside them,
        ``training_args.bin`` or a superseded ``.bin``, are not read); [] for none of them; None where the config's
        name is no file name (not followed here)."""
        try:
            named = json.loads((self.folder / "config.json").read_text(encoding="utf-8")).get("transformers_weights")
        except (OSError, ValueError, AttributeError):  # the config's own refusal says what is wrong with it
            named = None
        if named is not None:  # transformers refuses a name outside the folder itself, naming it
            inside = isinstance(named, str) and named and (self.folder / named).resolve().is_relative_to(
                self.folder.resolve())
            return self._with_shards(self.folder / named) if inside else None
        kinds = {None: WEIGHTS_FILES, True: WEIGHTS_FILES[:1], False: WEIGHTS_FILES[1:]}.get(self.use_safetensors,
                                                                                            WEIGHTS_FILES)
        for single, index in ((self._named(single), self._named(index)) for single, index in kinds):
            if single.is_file():  # a link to a missing file is none (transformers asks os.path.isfile)
                return [single]
            if index.is_file():
                return self._with_shards(index)
        return []

    def shadowed_index(self) -> tuple[Path, Path] | None:
        """``(single, index)`` where the folder holds both a single weights file the loader reads and a shard index of
        the same kind written after it (`save_pretrained(..., max_shard_size=...)` into the folder of an unsharded
        save, which transformers leaves in place): the loader reads the older single file and ignores the shards."""
        if self.weights_read is None or not self.folder.is_dir():
            return None
        for single, index in ((self._named(single), self._named(index)) for single, index in WEIGHTS_FILES):
            if self.weights_read[:1] == [single] and index.is_file():
                try:
                    newer = index.stat().st_mtime > single.stat().st_mtime
                except OSError:
                    return None
                return (single, index) if newer else None
        return None

    def _with_shards(self, path: Path) -> list[Path]:
        """``path``, and where it is a shard index (``*.json``) the shards it lists."""
        if not path.name.endswith(".json"):
            return [path]
        try:
            shards = json.loads(path.read_text(encoding="utf-8"))["weight_map"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # named by the loader's own check
            shards = ()
        return [path, *(self.folder / name for name in sorted(set(shards)) if isinstance(name, str))]

    def weights_files(self, suffix: str) -> list[Path]:
        """The files ending in ``suffix`` the loader reads (`weights_read`), or every such file in the folder where
        that is not known or none of transformers' names is there."""
        read = self.weights_read
        return [path for path in read if path.name.endswith(suffix)] if read else sorted(self.folder.glob(f"*{suffix}"))

    def missing_links(self) -> list[Path]:
        """config.json, the weights files the loader reads (shards too), or where it finds none the names it looks
        for, that are symbolic links to missing files (a hub cache whose blobs were deleted)."""
        names = self.weights_read or [self._named(name) for pair in WEIGHTS_FILES for name in pair]
        return [path for path in (self.folder / "config.json", *names) if path.is_symlink() and not path.exists()]

    def _named(self, name: str) -> Path:
        """``name`` in the folder, with the variant (transformers' ``_add_variant``: ``model.fp16.safetensors``)."""
        if self.variant:
            stem, _, suffix = name.rpartition(".")
            name = f"{stem}.{self.variant}.{suffix}"
        return self.folder / name


def _warn_shadowed_shards(checkpoint: Checkpoint) -> None:
    """Warn where the loader will read a single weights file while a shard index written after it lies beside it
    (`Checkpoint.shadowed_index`): an edited model saved sharded into its own folder would load unedited."""
    shadowed = checkpoint.shadowed_index()
    if shadowed is not None:
        single, index = shadowed
        warn(
            f"moelens.load: {str(checkpoint.folder)!r} holds both {single.name} and a shard index written after it "
            f"({index.name}, a later save_pretrained with max_shard_size?); transformers reads {single.name} and "
            f"ignores the shards, so what was saved last is not what loads. Remove {single.name} (or the shards and "
            "their index, if the single file is the one to keep).",
        )


def _hides_tiny(given: str) -> str:
    """What to do when ``given`` names moelens-tiny but a folder of that name in the working folder was taken for the
    user's ('' when it does not name moelens-tiny)."""
    from .data import TINY_NAMES

    if given not in TINY_NAMES:
        return ""
    others = [name for name in TINY_NAMES if name != given and not Path(name).is_dir()]
    way = f"pass {others[0]!r} for it" if others else "rename that folder to load it"
    return (f"a folder named {given!r} in the working folder is taken for yours, and it hides the built-in "
            f"moelens-tiny: {way}")


def load(path_or_repo_id: str | Path | None = None, *, tokenizer: Any = None,
         **from_pretrained_kwargs: Any) -> MoeTransformersModel | MoeNNsight:
    """Load a model (and its tokenizer) and wrap it; with no argument, moelens-tiny.

    The model class is the one the checkpoint was saved from (``config.architectures``), so a
    causal LM or a vision-language model keeps its head; a local folder without tokenizer
    files loads without a tokenizer (the model takes token ids only).

    Args:
        path_or_repo_id: A local folder (or a hub id, when the hub is reachable);
            None, ``"tiny"`` or ``"moelens-tiny"`` (when no local folder has that name) loads the embedded
            default model, offline; ``"tiny-dense"`` the shipped dense model (`moelens.data.TINY_DENSE_PATH`, a
            Qwen2 LM for `moelens.compress.tomoe`).
        tokenizer: A tokenizer to use instead of the one saved with the model (as for `wrap`).
        **from_pretrained_kwargs: Passed to ``from_pretrained`` (``dtype``,
            ``experts_implementation``, ...); the settings in `SOURCE_SETTINGS`
            (``trust_remote_code``, ``subfolder``, ...) also to the config and tokenizer.
            ``output_loading_info`` is read by moelens itself (to name weights that do not fit) and
            not returned: the result is the wrapped model alone.

    Returns:
        An nnsight model, as `wrap` returns it: ``.moes``, ``.layers[i].mlp`` (``Moe`` / ``Mlp``), ``.family``;
        in eval mode, with ``tokenizer`` or the checkpoint's own as ``.tokenizer``; without one (a folder with no
        tokenizer files) it has no ``.tokenizer`` and takes token ids only.

    Raises:
        MoelensError: ``path_or_repo_id`` is a file (a ``torch.save`` file is named as such), has no
            readable config.json, holds no weights, damaged weights files or shard index (named), or
            weights that do not fit its config (saved weights left unused while
            the model's own are missing, or of another shape), or a keyword ``from_pretrained``
            does not take.

    Warns:
        UserWarning: some saved weights have no place in the model, or some of the model's
            weights are not saved (they stay as initialised), or tokenizer files that do not load.
    """
    if path_or_repo_id is not None and not isinstance(path_or_repo_id, (str, os.PathLike)):
        given = type(path_or_repo_id).__name__
        raise MoelensError(
            f"moelens.load takes a checkpoint folder, a hub id or 'tiny', got a {given}: "
            + ("it is wrapped already, use it as it is." if isinstance(path_or_repo_id, (MoeNNsight, MoeTransformersModel))
               else "to wrap a model you have, use moelens.wrap(model, tokenizer=...)." if isinstance(path_or_repo_id, torch.nn.Module)
               else "pass a str or a pathlib.Path.")
        )
    refuse_lazy_loading(from_pretrained_kwargs, "moelens.load")
    from .data import TINY_DENSE_PATH, TINY_MODEL_PATH, TINY_NAMES

    shipped = {**dict.fromkeys(TINY_NAMES, TINY_MODEL_PATH), "tiny-dense": TINY_DENSE_PATH}
    if path_or_repo_id is None:
        path_or_repo_id = TINY_MODEL_PATH
    elif str(path_or_repo_id) in shipped and not Path(str(path_or_repo_id)).is_dir():
        path_or_repo_id = shipped[str(path_or_repo_id)]  # a user's folder of that name wins, a file of that name not
    source = str(user_path(path_or_repo_id))  # no hub id starts with ~
    if Path(source).is_file():
        raise MoelensError(
            f"{source!r} is a file; moelens.load takes the checkpoint folder holding config.json and the "
            f"weights: {_file_advice(Path(source))}."
        )
    settings = {name: from_pretrained_kwargs[name] for name in SOURCE_SETTINGS if name in from_pretrained_kwargs}
    folder = Path(source, settings.get("subfolder") or "")  # where a local checkpoint's files are
    checkpoint = Checkpoint(folder, from_pretrained_kwargs.get("variant"), from_pretrained_kwargs.get("use_safetensors"))
    _check_local_folder(path_or_repo_id, settings.get("subfolder") or "", checkpoint)
    _warn_shadowed_shards(checkpoint)
    config = _load_config(source, settings)
    from_pretrained_kwargs.pop("output_loading_info", None)  # moelens reads it (and returns the model only)
    model_class = _model_class(config)
    try:
        model, info = model_class.from_pretrained(source, output_loading_info=True, **from_pretrained_kwargs)
    except SafetensorError as error:
        raise _damaged_weights(source, checkpoint, error, ".safetensors") from error
    except pickle.UnpicklingError as error:  # a .bin that is no torch.save file, or holds more than tensors (torch
        raise _damaged_weights(source, checkpoint, error, ".bin") from error  # advised weights_only=False, unsafe)
    except (ValueError, KeyError, IndexError, AttributeError) as error:  # the others: a shard index without its
        # weight_map, torch's unpickling of a junk .bin (a bare KeyError or IndexError)
        _refuse_damaged_index(source, folder, error)
        if not isinstance(error, ValueError):
            if _unreadable_weights(checkpoint, ".bin"):  # a junk .bin the loader reads
                raise _damaged_weights(source, checkpoint, error, ".bin") from error
            raise
        advice = (" Load it with the transformers class that fits and pass it to moelens.wrap(model, tokenizer=...)."
                  if "Unrecognized configuration class" in str(error) else "")  # a sub-config saved alone
        raise MoelensError(f"cannot load a model from {source!r}: {sentence(error)}.{advice}") from error
    except RuntimeError as error:
        if "PytorchStreamReader" in str(error) or "might be corrupted" in str(error):  # torch's reader of a damaged
            # .bin (a zip, or a truncated legacy pickle) names no file
            raise _damaged_weights(source, checkpoint, error, ".bin") from error
        if "ignore_mismatched_sizes" not in str(error) and "size mismatch" not in str(error):
            raise  # out of memory, a device map, the checkpoint's own code: not moelens' to reword
        listed = _size_mismatches(model_class, source, from_pretrained_kwargs) or sentence(error)
        raise MoelensError(  # weights of another shape than the config's modules
            f"the weights saved at {source!r} do not fit the model its config describes: {listed}. Load them with "
            "the config they were saved with."
        ) from error
    except OSError as error:  # above all a folder with config.json but no weights
        if folder.is_dir() and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
            raise MoelensError(
                f"the folder {str(folder)!r} holds config.json but no weights file (model.safetensors or "
                "pytorch_model.bin); save the model into it with model.save_pretrained(folder), or pass "
                "the folder that holds its weights."
            ) from error
        raise MoelensError(
            f"cannot load the weights of {source!r}: {sentence(error)}. "
            + (_weights_files_advice(folder, from_pretrained_kwargs) if folder.is_dir() else
               "Pass a folder holding config.json and weights saved with save_pretrained.")
        ) from error
    except AssertionError as error:  # torch's "Torch not compiled with CUDA enabled" for device_map="cuda"
        if "not compiled with" not in str(error):
            raise
        raise MoelensError(
            f"cannot load {source!r} where device_map={from_pretrained_kwargs.get('device_map')!r} places it: "
            f"{sentence(error)} (this torch build has no such device). Load it without device_map (on the CPU), or "
            "install a torch build for that device."
        ) from error
    except TypeError as error:
        unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(error))
        if unexpected is None or unexpected.group(1) not in from_pretrained_kwargs:
            raise  # the checkpoint's own code: not moelens' to reword
        raise MoelensError(
            f"moelens.load passes its keywords to {model_class.__name__}.from_pretrained, which does not take "
            f"this one ({sentence(error)}); load the model with transformers and pass settings of the nnsight "
            "model to moelens.wrap(model, tokenizer=..., **nnsight_kwargs)."
        ) from error
    _check_weights_fit(source, info)
    model.eval()
    return wrap(model, tokenizer=tokenizer if tokenizer is not None else _load_tokenizer(source, settings))


#: A weights file saved with ``variant=`` (``model.v1.safetensors``, ``model.v1-00001-of-00002.safetensors``).
VARIANT_FILE = re.compile(r"(?:model|pytorch_model)\.([\w]+)(?:-\d+-of-\d+)?\.(?:safetensors|bin)")
#: One shard of sharded weights, which transformers finds through the shard index beside them.
SHARD_FILE = re.compile(r".+-\d+-of-\d+\.(?:safetensors|bin)")


def _weights_files_advice(folder: Path, from_pretrained_kwargs: dict) -> str:
    """What to do about a checkpoint ``folder`` whose weights files transformers did not find or read: pass the
    ``variant=`` they were saved with (where none, or another, was passed), or none (where they were saved without),
    restore the shard index, or (where none of that explains it) save them again."""
    files = sorted(path.name for path in folder.iterdir() if path.suffix in (".safetensors", ".bin"))
    variants = sorted({match.group(1) for match in map(VARIANT_FILE.fullmatch, files) if match})
    asked = from_pretrained_kwargs.get("variant")
    listed = f"{', '.join(files[:3])}{', ...' if len(files) > 3 else ''}"
    if variants and asked not in variants:
        return (f"Its weights were saved with variant={variants[0]!r} ({listed}): load it with "
                f"moelens.load(folder, variant={variants[0]!r}).")
    if asked is not None and files and not variants:
        return f"Its weights were saved with no variant ({listed}): load it without variant={asked!r}."
    if any(SHARD_FILE.fullmatch(name) for name in files) and not any(folder.glob("*.index*.json")):
        return (f"It holds {len(files)} shards of weights ({files[0]}, ...) but not their index (the .index.json "
                "file saved with them, such as model.safetensors.index.json), which names the shard of each weight: "
                "copy it in from where the shards came from.")
    return ("Copy in every file of the checkpoint (save_pretrained writes the weights and, for shards, their index), "
            "or save the model into the folder again with save_pretrained.")


def _file_advice(file: Path) -> str:
    """What to pass instead of ``file``, a file given as a checkpoint: its folder when that holds config.json (and
    ``file`` is no ``torch.save`` file of the user's own beside it); the way to open a ``torch.save`` file (not a
    checkpoint) when ``file`` is one; else the checkpoint folder."""
    in_checkpoint = (file.parent / "config.json").is_file()
    # save_pretrained's own torch.save files are pytorch_model*.bin: the checkpoint's weights
    if in_checkpoint and not (not file.name.startswith("pytorch_model") and _torch_saved(file)):
        return f"pass {str(file.parent)!r}"
    if _torch_saved(file):
        return ("this one was written by torch.save, not save_pretrained. Open a model saved with torch.save(model, "
                "path) with moelens.wrap(torch.load(path, weights_only=False)), only from a source you trust "
                "(unpickling runs its code); a file of weights alone (a state_dict) loads into the model built from "
                "its config (model.load_state_dict(torch.load(path))), or save that model with save_pretrained and "
                "pass the folder" + (f" (for the checkpoint beside it, pass {str(file.parent)!r})" if in_checkpoint
                                     else ""))
    return "pass that folder"


def _torch_saved(file: Path) -> bool:
    """Whether ``file`` is what ``torch.save`` writes: a zip archive holding a ``data.pkl``, or (the legacy format) a
    pickle. Only the first bytes and the zip's listing are read: nothing is unpickled."""
    try:
        if zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as archive:
                return any(name.rpartition("/")[2] == "data.pkl" for name in archive.namelist())
        with open(file, "rb") as handle:
            head = handle.read(2)
    except (OSError, zipfile.BadZipFile):
        return False
    return len(head) == 2 and head[0] == 0x80 and head[1] <= 5  # pickle's PROTO opcode and a protocol it knows


def _unreadable_weights(checkpoint: Checkpoint, suffix: str = ".safetensors") -> list[Path]:
    """The weights files ending in ``suffix`` the loader reads (`Checkpoint.weights_files`) that cannot be opened (a
    damaged or truncated file, such as one shard of a sharded checkpoint): ``.safetensors`` whose header safetensors
    refuses, ``.bin`` whose zip listing (what torch.save writes) zipfile refuses, a legacy pickle aside; only headers
    and listings are read."""
    if not checkpoint.folder.is_dir():
        return []
    unreadable = []
    for path in checkpoint.weights_files(suffix):
        try:
            if suffix == ".safetensors":
                with safe_open(str(path), framework="pt"):
                    pass
            elif not _torch_saved(path):  # not a zip holding data.pkl, nor a legacy pickle
                unreadable.append(path)
        except (SafetensorError, OSError):
            unreadable.append(path)
    return unreadable


#: How a Git LFS pointer file begins: what a checkout without git-lfs holds in place of each large file.
LFS_POINTER = b"version https://git-lfs"


def _starts_with(path: Path, head: bytes) -> bool:
    with path.open("rb") as file:
        return file.read(len(head)) == head


def _damaged_weights(source: str, checkpoint: Checkpoint, error: Exception, suffix: str) -> MoelensError:
    """The refusal of loading ``source``, whose loader raised ``error`` on a weights file ending in ``suffix`` that
    cannot be read: the files of ``checkpoint`` that are damaged or truncated named (the weights as a whole where
    none is found), and Git LFS pointers, which a checkout without git-lfs holds instead of the weights, told."""
    files = _unreadable_weights(checkpoint, suffix)
    pointers = [path for path in files if _starts_with(path, LFS_POINTER)]
    if not files and isinstance(error, pickle.UnpicklingError):  # a sound file holding more than tensors
        return MoelensError(
            f"a weights file of {source!r} holds objects other than tensors, which torch's safe loading (weights_only) "
            "refuses: save the model again with save_pretrained (safetensors), from a source you trust."
        )
    if files:
        total = len(checkpoint.weights_files(suffix))
        named = f" ({', '.join(repr(str(path)) for path in files)}: {len(files)} of its {total} weights files)"
    else:
        named = ""
    if pointers and len(pointers) == len(files):
        return MoelensError(
            f"the weights of {source!r} cannot be read{named}: {'they are' if len(files) > 1 else 'it is a'} Git LFS "
            f"pointer{'s' if len(files) > 1 else ''}, not the weights (a clone made without git-lfs); fetch them with "
            "`git lfs pull` in that checkout, or download the checkpoint again."
        )
    # unpickling junk: a bare number (KeyError), or torch's advice to load it unsafely (UnpicklingError)
    detail = "" if isinstance(error, (KeyError, IndexError, pickle.UnpicklingError)) else f" ({sentence(error)})"
    return MoelensError(
        f"a weights file of {source!r} cannot be read{detail}: it is damaged or truncated{named}; save the model again "
        "with save_pretrained, or copy it again."
    )


def _refuse_damaged_index(source: str, folder: Path, error: Exception) -> None:
    """Raise, for ``error`` from loading ``source``, a `MoelensError` naming the shard index file in ``folder``
    (``*.index.json``, which lists the shard of each weight) that is not JSON or holds no ``weight_map`` object;
    return when every one is sound."""
    if not folder.is_dir():
        return
    for index in sorted(folder.glob("*.index.json")):
        try:
            listed = json.loads(index.read_text(encoding="utf-8"))
            reason = "" if isinstance(listed, dict) and isinstance(listed.get("weight_map"), dict) else (
                "it holds no weight_map object")
        except ValueError as unreadable:  # not JSON, or not UTF-8 text
            reason = sentence(unreadable)
        if reason:
            raise MoelensError(
                f"cannot load a model from {source!r}: its shard index {str(index)!r}, which lists the weights file "
                f"of each weight, is damaged ({reason}); save the model again with save_pretrained, or restore that "
                "file (copy it again)."
            ) from error


def _load_config(source: str, settings: dict[str, Any]) -> Any:
    """The checkpoint's config, or a `MoelensError` saying why there is none."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, **settings)
    except (OSError, ValueError, StrictDataclassError) as error:  # StrictDataclassError: a config that contradicts itself
        has_config = (user_path(source) / settings.get("subfolder", "") / "config.json").is_file()
        remedy = ("Its config.json is not one this transformers can read: fix it (or update transformers for a "
                  "model type it does not know)." if has_config else
                  "Pass a local folder holding config.json and weights (or 'tiny' for the embedded default model).")
        if not user_path(source).exists():  # a name taken for a hub id: say the other reading too
            remedy = f"No local folder {source!r} is here either (in {str(Path.cwd())!r}). {remedy}"
        reason = " ".join(sentence(error).split())  # one line: transformers' messages run over several
        if "trust_remote_code" in reason:  # custom code not trusted: transformers' advice is the remedy
            remedy = "(That code runs in this process: trust it first.)"
        raise MoelensError(f"cannot load a model from {source!r}: {reason}. {remedy}") from error


def _model_class(config: Any) -> Any:
    """The class to load ``config``'s checkpoint with: the transformers class it was saved from (when built
    for this config class), else the causal-LM, image-text-to-text or base auto class (custom code: the
    auto classes read its auto_map)."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    for name in getattr(config, "architectures", None) or ():
        saved = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
        # the class must be built for this config: not custom code's own config class (trust_remote_code: the
        # auto classes read its auto_map) nor another model type (an architectures entry left from a conversion)
        if isinstance(saved, type) and issubclass(saved, transformers.PreTrainedModel) and (
                getattr(saved, "config_class", None) is type(config)):
            return saved
    custom = getattr(config, "auto_map", None) or {}  # a checkpoint with its own code (trust_remote_code)
    model_type = getattr(config, "model_type", None)
    for auto, names in ((transformers.AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                        (transformers.AutoModelForImageTextToText, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)):
        # transformers' own model types, and config classes the user registered with the auto class
        if model_type in names or type(config) in auto._model_mapping or auto.__name__ in custom:
            return auto
    return _own_class(config) or transformers.AutoModel


def _own_class(config: Any) -> Any:
    """For a config no auto class maps (a multimodal model's text decoder: step3p7's ``step3p5``), the
    class of its own transformers modeling module built for it (a causal LM first), else None."""
    import importlib

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    package = type(config).__module__.rpartition(".")[0]
    if getattr(config, "model_type", None) in MODEL_MAPPING_NAMES or not package.startswith("transformers.models."):
        return None
    try:
        module = importlib.import_module(f"{package}.modeling_{package.rpartition('.')[2]}")
    except ImportError:
        return None
    fits = [value for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, transformers.PreTrainedModel)
            and value.__module__ == module.__name__ and getattr(value, "config_class", None) is type(config)
            and not value.__name__.endswith("PreTrainedModel")]
    fits.sort(key=lambda cls: "ForCausalLM" not in cls.__name__)
    return fits[0] if fits else None


#: How the files of a saved tokenizer are named (tokenizer.json, tokenizer_config.json,
#: vocab.json, vocab.txt, merges.txt, tokenizer.model, spiece.model, tekken.json ...).
TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "tekken")


def _load_tokenizer(source: str, settings: dict[str, Any]) -> Any:
    """The tokenizer saved at ``source``, or None when there is none.

    A local folder without tokenizer files has none: transformers 5 would otherwise build
    a placeholder from the config's model type (one token), which cannot tokenize text.
    Tokenizer files that fail to load give None and a warning naming the cause.
    """
    folder = Path(source, settings.get("subfolder", ""))
    if folder.is_dir() and not any(
        file.is_file() and file.name.startswith(TOKENIZER_FILE_PREFIXES) for file in folder.iterdir()
    ):
        return None
    try:
        tokenizer = _tokenizer_class(source, settings).from_pretrained(source, **settings)
    except (OSError, ValueError, TypeError) as error:
        pointers = [file.name for file in folder.iterdir() if file.is_file() and
                    file.name.startswith(TOKENIZER_FILE_PREFIXES) and _starts_with(file, LFS_POINTER)] \
            if folder.is_dir() else []
        fix = (f"{', '.join(pointers)} {'are Git LFS pointers' if len(pointers) > 1 else 'is a Git LFS pointer'}, not "
               "the file (a clone made without git-lfs): fetch it with `git lfs pull` in that checkout"
               if pointers else "fix or re-save the tokenizer files")
        warn(
            f"moelens.load: the tokenizer saved at {source!r} does not load ({type(error).__name__}: "
            f"{sentence(error)}), so the model takes token ids only; {fix}, or pass one with "
            "moelens.wrap(model, tokenizer=...).",
        )
        return None
    if _placeholder(tokenizer):  # built by transformers without the vocabulary: text gave no tokens
        warn(
            f"moelens.load: the tokenizer saved at {source!r} has no vocabulary (its {len(tokenizer)} tokens are all "
            "special or added ones: its files hold settings alone, such as a tokenizer_config.json), so the model "
            "takes token ids only; copy the tokenizer's other files (tokenizer.json, vocab.json ...) beside it, or "
            "pass one with moelens.wrap(model, tokenizer=...).",
        )
        return None
    return tokenizer


def _placeholder(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` holds no vocabulary but its special and added tokens (transformers' placeholder for a
    model type's tokenizer class whose vocabulary files are missing)."""
    try:
        return len(tokenizer.get_vocab()) <= len(tokenizer.get_added_vocab())
    except (AttributeError, NotImplementedError, TypeError):  # a tokenizer of another kind: taken as it is
        return False


def _tokenizer_class(source: str, settings: dict[str, Any]) -> Any:
    """``PreTrainedTokenizerFast`` where the tokenizer files at ``source`` (a folder, or a hub id's files as
    transformers finds them: cache, ``revision``, ``subfolder``) declare that generic class (or ``TokenizersBackend``),
    or have no ``tokenizer_config.json`` at all (a ``tokenizer.json`` alone, as the tokenizers library saves it),
    beside a ``tokenizer.json`` and no code of their own (``auto_map``), else ``AutoTokenizer``.

    For some model types (qwen2, qwen3_5_moe ...) transformers 5 replaces such a declared class with the model type's
    own tokenizer class, whose pre-tokenizer can split text into other ids than the ``tokenizer.json`` the model was
    trained with (moelens' tiny-dense, a qwen2 model: ``"\\n  return"`` in three tokens instead of two).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import get_tokenizer_config
    from transformers.utils import cached_file

    found = {name: value for name, value in settings.items() if name != "trust_remote_code"}
    try:
        declared = get_tokenizer_config(source, **found)
        generic = (isinstance(declared, dict)  # no tokenizer_config.json at all ({}): a tokenizers library's file
                   and (declared.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES or declared == {})
                   and "auto_map" not in declared
                   and cached_file(source, "tokenizer.json", _raise_exceptions_for_missing_entries=False,
                                   _raise_exceptions_for_connection_errors=False, **found) is not None)
    except (OSError, ValueError):  # no such files, or not JSON: transformers' own rules apply
        return AutoTokenizer
    return PreTrainedTokenizerFast if generic else AutoTokenizer


#: The tokenizer classes that load a ``tokenizer.json`` as it is, whatever the model type.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _size_mismatches(model_class: Any, source: str, kwargs: dict[str, Any], shown: int = 3) -> str:
    """The saved weights whose shape is not the model's, in words (``""`` when they cannot be listed).

    transformers names them only in a logged report; this loads the checkpoint once more, letting
    the mismatches through, to name them.
    """
    loading_logger = logging.getLogger("transformers.modeling_utils")
    level = loading_logger.level
    loading_logger.setLevel(logging.ERROR)  # the report again: once was enough
    try:
        _, info = model_class.from_pretrained(source, **{**kwargs, "ignore_mismatched_sizes": True,
                                                         "output_loading_info": True})
    except Exception:  # noqa: BLE001 - only a better message is at stake
        return ""
    finally:
        loading_logger.setLevel(level)
    mismatched = sorted(info.get("mismatched_keys") or ())
    listed = "; ".join(f"{key} is saved as {list(saved)}, the model has {list(made)}" for key, saved, made in mismatched[:shown])
    more = f" (and {len(mismatched) - shown} more)" if len(mismatched) > shown else ""
    return f"{len(mismatched)} weights have another shape: {listed}{more}" if mismatched else ""


def _check_weights_fit(source: str, info: dict[str, Any]) -> None:
    """Raise when the checkpoint's weights and its config's model do not match; warn when part of them do not.

    Weights of the checkpoint the model has no place for, while weights of the model got
    none, mean the config does not describe the saved modules (a model converted with
    `moelens.compress.tomoe` and saved with ``save_pretrained``: its config is still the
    dense model's): transformers would leave those weights random.
    """
    unexpected, missing = sorted(info.get("unexpected_keys") or []), sorted(info.get("missing_keys") or [])
    if unexpected and missing:
        raise MoelensError(
            f"the checkpoint at {source!r} does not match the model its config describes: {len(unexpected)} saved "
            f"weights have no place in it (e.g. {unexpected[0]!r}) and {len(missing)} of its weights are not "
            f"saved (e.g. {missing[0]!r}), so they would be random. A model converted with "
            "moelens.compress.tomoe keeps its dense config: save it with torch.save(model) and load it with "
            "torch.load(path, weights_only=False), then moelens.wrap it."
        )
    if missing:
        warn(
            f"moelens.load: {len(missing)} weights of the model are not saved at {source!r} (e.g. {missing[0]!r}): "
            "they keep their initial (random) values; check that the config matches the checkpoint.",
        )
    if unexpected:
        warn(
            f"moelens.load: {len(unexpected)} weights saved at {source!r} have no place in the model (e.g. "
            f"{unexpected[0]!r}) and are left out; check that the config matches the checkpoint.",
        )
