"""Plots of training metrics."""
