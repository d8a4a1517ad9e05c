"""The demo and its model on the UCI Adult data.  Not part of the runtime: only
``zps-server demo`` loads it, lazily."""
