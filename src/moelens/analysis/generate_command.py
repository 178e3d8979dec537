"""``moelens generate MODEL --prompt TEXT``: generate from a prompt and print which experts every token went to.

A command-line front to `collect_generation`: the generated text, then the per-token expert table of the
prompt and of every generated token the model read (``--json``: the same as data).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..edit_options import EDIT_OPTIONS, check_layer_edits, make_edits, parse_edit_options
from ..errors import MoelensError
from .cli import load_model, set_threads

def run_generate(args: argparse.Namespace) -> int:
    """``moelens generate MODEL --prompt TEXT``."""
    import torch

    from .generation import collect_generation

    set_threads(args.threads)
    if args.layers is not None and len(set(args.layers)) != len(args.layers):
        raise MoelensError(f"--layers names a layer more than once ({' '.join(map(str, args.layers))}); give each once.")
    edits = parse_edit_options(args)
    model = load_model(args.model, needs_tokenizer=True)
    intervene = _edits_of(model, edits)
    torch.manual_seed(args.seed)
    run = collect_generation(model, [args.prompt], max_new_tokens=args.max_new_tokens, layers=args.layers,
                             do_sample=args.sample, intervene=intervene)
    generated = run.generated(0)
    text = model.tokenizer.decode(generated)
    view = run.token_routing(0)
    if args.json:
        print(json.dumps({
            "prompt": args.prompt,
            "generated": text,
            "generated_ids": generated.tolist(),
            "tokens": view.tokens,
            "token_ids": view.token_ids.tolist(),
            "layers": view.layers,
            "experts": view.indices.tolist(),
            "weights": [[[round(weight, 6) for weight in slots] for slots in layer] for layer in view.weights.tolist()],
        }, indent=1))
        return 0
    print(f"prompt     {args.prompt!r}\ngenerated  {text!r}\n")
    print(f"experts:weights per MoE layer of the {len(view.tokens)} tokens the model read (the prompt's, then the "
          "generated ones but the last):")
    print(view.table())
    return 0


def _edits_of(model: Any, edits: dict[str, dict[int, Any]]) -> Any:
    """The ``intervene`` of `collect_generation` that makes the edit options' edits on their layers' blocks at every
    step (None: no edit given); a layer with no MoE block, or with several, is refused naming the option."""
    named = sorted({layer for option in EDIT_OPTIONS for layer in edits[option]})
    if not named:
        return None
    blocks = [moe.layer for moe in model.moes]
    single = sorted(layer for layer in set(blocks) if blocks.count(layer) == 1)
    for layer in named:
        option = next(option for option in EDIT_OPTIONS if layer in edits[option])
        if layer not in single:
            where = "has no MoE block" if layer not in blocks else "holds several MoE blocks"
            raise MoelensError(f"--{option.replace('_', '-')} {layer}:...: layer {layer} {where}; "
                               + (f"the layers of one MoE block are {single}." if single else
                                  "this model has no layer of one MoE block to edit."))
        moe = model.moes[blocks.index(layer)]
        check_layer_edits(layer, moe.num_experts, **{option: edits[option].get(layer) for option in EDIT_OPTIONS})

    def intervene(moe: Any) -> None:
        make_edits(moe, **{option: edits[option].get(moe.layer) for option in EDIT_OPTIONS})

    return intervene
