"""Flower app entry points for fedlora-audit (the code lives in fl.flower)."""
