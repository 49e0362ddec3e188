"""`python -m radix_backend.server --model ...` (same flags as `radix-backend serve`)."""

from .app import main

main()
