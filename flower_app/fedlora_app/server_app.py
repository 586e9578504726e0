"""ServerApp component: the engine's round loop over grid.send_and_receive."""

from fl.flower.serverapp import app

__all__ = ["app"]
