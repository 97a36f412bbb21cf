"""What a quantisation scheme tells the layers it applies to."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.layers.linear_method import LinearMethod


class QuantizationConfig(abc.ABC):
    """One quantisation scheme of a model: the ``LinearMethod`` of its linear layers and
    whether its LM head is quantised too. Frozen: built once, from the command line and the
    checkpoint's config."""

    name: str

    @abc.abstractmethod
    def linear_method(self) -> LinearMethod:
        """The method every decoder linear layer holds its weight with."""

    @abc.abstractmethod
    def quantizes_lm_head(self) -> bool:
        """Whether the LM head is quantised when the model is packed."""

    def lm_head_group_size(self) -> int | None:
        """Inputs per scale of a quantised LM head's int8 weight (None: one scale per row)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
