"""`Mlp`: a dense feed-forward block (the dense layers of a mixed or dense model, and an MoE block's shared expert
where it is a dense MLP: ``moe.shared_experts``).

Serves what the block adds to the residual stream (`mlp_output`; of a shared expert, its own output, before the
gate a block may apply: the block's ``shared_expert_output`` is after it) and its hidden
activations (`mlp_activation`, alias `mlp_neurons`): the input of its down
projection, ``[batch, seq, intermediate]``. The routing values of a `Moe` raise
here with the reason (this block runs no mixture) instead of an AttributeError.
"""

from __future__ import annotations

import functools
import inspect
from functools import cached_property
from typing import Any, Callable, NoReturn

from jaxtyping import Float
from torch import Tensor, nn

from ..errors import ValueUnavailable
from ..families.entry import VALUE_NAMES
from ..modules import is_modules_to_save
from .base import Component
from .binding import Binding, argument, copied, output_of
from .served import served

#: Child names of the down projection in dense MLPs, tried in order.
DOWN_PROJECTIONS = ("down_proj", "c_proj", "fc2", "w2", "output_linear", "dense_4h_to_h", "wo", "out_proj", "fc_out")

#: Child names of the up (or gate) projection in dense MLPs. A module with a down projection
#: (`DOWN_PROJECTIONS`) but none of these is no MLP: an SSM mixer's ``in_proj`` / ``out_proj``.
UP_PROJECTIONS = ("up_proj", "gate_proj", "gate_up_proj", "c_fc", "fc1", "w1", "w3", "input_linear",
                  "dense_h_to_4h", "wi", "wi_0", "wi_1", "fc_in")

#: Decoder layers that edit their MLP's output in place after it returns (falcon's adds the attention output to
#: it under ``parallel_attn`` / ``new_decoder_architecture``), with the paths (from the layer) of the blocks whose
#: output is that tensor: the MLP, and the down projection it returns as is (converted by moelens.compress
#: ``target_modules``). The reader of their ``mlp_output`` keeps a copy, and the model gets its own (a read would
#: show the sum, and a written tensor would be changed).
EDIT_MLP_OUTPUT_LATER = {"FalconDecoderLayer": ("mlp", "mlp.dense_4h_to_h")}

#: Moe values a dense block cannot serve.
MIXTURE_VALUES = tuple(name for name in VALUE_NAMES if name != "mlp_output") + ("selection_scores",)


class Mlp(Component):
    """A dense MLP block: serves ``mlp_output`` [b, s, M] (what it adds to the residual stream) and
    ``mlp_activation`` (alias ``mlp_neurons``) [b, s, intermediate] (the input of its down projection); the
    routing values of a `Moe` raise here with the reason. More in the ``moelens.components.mlp`` module docstring.

    `Moe` subclasses it (an MoE block serves ``mlp_output`` too): ``isinstance(block, Moe)`` tells an MoE block from a
    dense one, ``isinstance(block, Mlp)`` holds for both."""

    @served
    def mlp_output(self, value: Any) -> Float[Tensor, "b s m"]:
        """The block's output [b, s, M]: what a dense MLP adds to the residual stream. Writing it replaces that.

        For a block that adds the residual itself (bloom's), the output of its down projection. For an MoE block's
        shared expert, its output before any gate the block applies (what the block adds: `shared_expert_output`)."""

    @served
    def mlp_activation(self, value: Any) -> Float[Tensor, "b s i"]:
        """The block's hidden activations, [batch, seq, intermediate]: the input of its down projection. Writing it changes what the down projection sees."""

    @served
    def mlp_neurons(self, value: Any) -> Float[Tensor, "b s i"]:
        """Alias of `mlp_activation`."""

    @property
    def _running_copy(self) -> tuple[str, nn.Module]:
        """(path from the block, module) of what runs as this block: the block itself, or in a PEFT
        ``modules_to_save`` wrapper the copy that runs now (the active adapter's; the frozen original inside
        ``disable_adapter()``), found at each binding, so ``set_adapter`` after a read is followed."""
        wrapper = self._module
        if not is_modules_to_save(wrapper):
            return "", wrapper
        if getattr(wrapper, "disable_adapters", False):
            return "original_module.", wrapper.original_module
        active = getattr(wrapper, "active_adapter", None)
        active = active[0] if isinstance(active, (list, tuple)) and active else active
        copy = wrapper.modules_to_save._modules.get(active) if isinstance(active, str) else None
        return ("", wrapper) if copy is None else (f"modules_to_save.{active}.", copy)

    @property
    def down_projection(self) -> str | None:
        """Path from the block of the child whose input is the hidden activation (in the copy that runs:
        `_running_copy`), or None."""
        prefix, running = self._running_copy
        return next((f"{prefix}{name}" for name in DOWN_PROJECTIONS if name in running._modules), None)

    def __getattr__(self, name: str) -> Any:
        """A `Moe`'s own attribute (``router``, ``num_experts``, ``order`` ...) is missing here with the reason:
        an AttributeError still, so ``hasattr(block, "router")`` tells the kinds of block apart."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            from .moe import Moe

            moe_only = name in ("router", "experts") or not name.startswith("_") and hasattr(Moe, name)
            if isinstance(self, Moe) or not moe_only:  # a Moe's property that raised AttributeError comes here too
                raise
            raise AttributeError(f"{self.path} has no {name}: {self._dense} ({self._moe_layers}).") from None

    def no_mixture(self, name: str = "router_logits") -> ValueUnavailable:
        """The error for a mixture value on this dense block."""
        return self.unavailable(name, self._dense, f"{self._moe_layers}.")

    @property
    def _dense(self) -> str:
        return f"this block ({type(self._module).__name__}) is a dense MLP and runs no mixture of experts"

    @property
    def _moe_layers(self) -> str:
        from .moe import Moe  # the Moe component imports this module

        owner = self.parent if isinstance(self.parent, Moe) else self._shared_of
        if owner is not None:  # a block's shared expert (granite's on its layer); gemma4's MLP beside the experts
            layer = (f", the decoder layer itself (model.layers[{owner.layer}])"
                     if owner.family.block_attr == "" else "")
            return (f"it runs beside the experts as the shared expert of the MoE block {owner.path}{layer}: use "
                    "that block")
        wrapped = list(getattr(self.root, "moes", []))
        if any(block is self for block in wrapped):  # given to an MoE block's envoy after wrapping
            return ("it was given to the envoy of the MoE block wrapped here, replacing the block: read its mlp_output, "
                    "or wrap the model again (moelens.wrap(model._module)), after which model.moes leaves it out")
        moes = sorted({moe.layer for moe in wrapped}, key=lambda layer: (layer is None, layer))
        where = f"MoE layers are {moes}" if moes else "this model has no MoE layer"
        return f"{where}; iterate model.moes for the MoE blocks"

    def params(self, expert: Any = None) -> NoReturn:
        """Not served on a dense block: raises the reason (`Moe.params` serves a MoE block's expert weights; a dense
        MLP's are its modules' own, ``block.<projection>.weight``)."""
        raise self.no_mixture("params()")

    def _order(self) -> tuple[str, ...]:
        return ("mlp_activation", "mlp_output")

    @property
    def _shared_of(self) -> Any:
        """The `Moe` whose shared expert this block is, or None."""
        from .moe import Moe  # the Moe component imports this module

        parent = self.parent
        if isinstance(parent, Moe):
            return parent if parent.family.shared is not None else None
        for block in getattr(parent, "_children", ()):  # granite's shared expert: the block's sibling on its layer
            shared = block.family.shared if isinstance(block, Moe) else None
            if shared is not None and shared.on_layer and getattr(parent._module, shared.module, None) is self._module:
                return block
        return None

    def _order_error(self, name: str, by: str = "", step_passed: bool = False) -> Any:
        """`Component._order_error`, which for a block's shared expert also says where its values fall among the
        block's (where the block calls it: `moe.order()` places only its gated output)."""
        error = super()._order_error(name, by, step_passed)
        moe = self._shared_of
        if moe is not None:
            spec = moe.family.shared
            where = {
                "before_router": "before its router: read them before the block's other values",
                "before_experts": "between its router and its experts: read them after router_logits, before "
                                  "expert_weights (the block's order: moe.order())",
                "after_experts": "after its experts: read them after routed_output, before mlp_output",
                "after_block": "after the block: read them after mlp_output",
            }[spec.when]
            if spec.gated_op:  # the served value is the gate's product; the module itself may run anywhere before it
                where = "before its router (the gated output it serves comes after the experts): read them before " \
                        "the block's values"
            caller = "its decoder layer" if spec.on_layer else "the block"  # granite's: the block's sibling
            error.args = (f"{error.args[0]} {self.path} is the shared expert of {moe.path}: {caller} calls it "
                          f"{where}, or in a trace of their own.",)
        return error

    @property
    def _adds_the_residual(self) -> bool:
        """The block's forward (of the copy that runs: `_running_copy`) takes the residual stream and returns it with
        its own part added (bloom)."""
        return _takes_residual(type(self._running_copy[1]))

    @cached_property
    def _output_edited_later(self) -> bool:
        """The decoder layer holding this block edits the block's output in place (`EDIT_MLP_OUTPUT_LATER`)."""
        modules, parts = list(self.modules_down()), self.path.split(".")
        return any(
            len(modules) > depth
            and ".".join(parts[-depth:]) in EDIT_MLP_OUTPUT_LATER.get(type(modules[-1 - depth]).__name__, ())
            for depth in (1, 2)  # the block is the layer's MLP, or the down projection inside it
        )

    def _binding(self, name: str) -> Binding:
        sliced = getattr(self._module, "slow_but_exact", False) and getattr(self._module, "pretraining_tp", 1) > 1
        if sliced and (name != "mlp_output" or self._adds_the_residual):
            raise self.unavailable(  # bloom's exact tensor-parallel emulation: F.linear on slices of the weight
                name,
                f"{type(self._module).__name__} (pretraining_tp > 1, slow_but_exact) runs its down projection as "
                "slices of its weight, never calling the module, and adds the residual stream itself",
                "set slow_but_exact = False on each block's MLP (the same maths in one call: for block in "
                "model._module.transformer.h: block.mlp.slow_but_exact = False, on the torch modules), or load with "
                "slow_but_exact=False.",
            )
        if name == "mlp_output":
            shared_of = self._shared_of
            if shared_of is not None and shared_of.family.shared.edited_later:  # llama4's out.add_(routed)
                raise self.unavailable(
                    name, f"{shared_of.family.name}'s block adds its routed output to this shared expert's output in "
                    "place, so moelens serves that output as the block's shared_expert_output alone (a copy each "
                    "would lose one's writes)", f"read or write {shared_of.path}.shared_expert_output")
            pick, put = output_of(None)
            down = self.down_projection if self._adds_the_residual else None
            if down is not None:  # it adds the residual: its part is the down projection's output
                return Binding(f"{self.path}.{down}.output", features=1, pick=pick, put=put,
                               to_view=self._batched(name))
            copy = copied if self._output_edited_later else None
            return Binding(f"{self.path}.output", features=1, pick=pick, put=put, to_view=self._batched(name, copy),
                           from_view=copy)
        if name in ("mlp_activation", "mlp_neurons"):
            down = self.down_projection
            if down is None:
                raise self.unavailable(
                    name,
                    f"{type(self._module).__name__} has no down projection named one of {DOWN_PROJECTIONS}",
                    "read the input of its last linear layer with .inputs instead.",
                )
            pick, put = argument(0, advice=f"call {down} with its input first ({down}(x)).")
            return Binding(f"{self.path}.{down}.input", features=1, pick=pick, put=put, to_view=self._batched(name))
        raise self.no_mixture(name)

    def _batched(self, name: str, then: Callable[[Tensor, Any], Tensor] | None = None
                 ) -> Callable[[Tensor, Any], Tensor] | None:
        """`Binding.to_view` for a block outside the text decoder's layers (a vision tower's): it refuses flat
        ``[tokens, ...]`` tensors, whose tokens (image patches, gathered over the images) no ``[batch, seq]`` view
        places; ``then``: the block's own ``to_view``. None (or ``then``) for a block of the decoder's layers."""
        structure = getattr(self.root, "_structure", None)
        layers = getattr(structure, "layers", None)
        if layers is None or self.path.partition(".")[2].startswith(f"{layers}."):
            return then

        def to_view(tensor: Tensor, context: Any) -> Tensor:
            if tensor.dim() == 2:
                raise self.unavailable(
                    name,
                    f"this dense MLP runs outside the text decoder's layers ({layers}) on {tensor.shape[0]} flat "
                    "tokens (a vision tower's patches, gathered over the images), which no [batch, seq] view places",
                    f"read its tensors with plain nnsight ({self.path}.output, or its projections' .input).",
                )
            return tensor if then is None else then(tensor, context)

        return to_view


@functools.cache
def _takes_residual(module_class: type) -> bool:
    """Whether ``module_class``'s forward takes the residual stream (`Mlp._adds_the_residual`; looked up once a class:
    a signature costs a read of mlp_output several microseconds)."""
    try:
        return "residual" in inspect.signature(module_class.forward).parameters
    except (TypeError, ValueError):
        return False


def _refuse_mixture_value(name: str) -> property:
    def getter(self: Mlp) -> Any:
        raise self.no_mixture(name)

    def setter(self: Mlp, value: Any) -> None:
        raise self.no_mixture(name)

    return property(getter, setter, doc=f"Not served on a dense block: raises the reason ({name} is a Moe value).")


for _name in MIXTURE_VALUES:
    setattr(Mlp, _name, _refuse_mixture_value(_name))
