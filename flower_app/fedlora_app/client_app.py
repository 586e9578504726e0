"""ClientApp component: the methods' on_<stage> handlers, one Flower action each."""

from fl.flower.clientapp import app

__all__ = ["app"]
