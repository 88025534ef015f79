"""Recipes that ship with quantlab (installed as `quantlab.recipes`; `quantlab recipes` lists them)."""
