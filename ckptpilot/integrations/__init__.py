"""Adapters for the frameworks most training runs go through: each module imports its
framework, so importing ``ckptpilot`` never does (install the matching extra, e.g.
``pip install 'ckptpilot[hf]'``)."""
