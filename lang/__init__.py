"""SGLang-style frontend language (imports as radix_backend.lang)."""
