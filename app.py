"""REST Lab: watch retrieval-based speculative decoding draft, verify and accept tokens.

`python app.py` serves the page on 127.0.0.1:7860 (GRADIO_SERVER_NAME and GRADIO_SERVER_PORT,
or --host and --port, override); a Hugging Face Space runs this file as it is.  The page is
built in rest_core/app/ui.py (`demo` here is what Gradio's reload mode and Spaces look for).
"""
from rest_core.app.ui import build_demo, launch, main

demo = build_demo()

if __name__ == "__main__":
    main(demo)

__all__ = ["build_demo", "demo", "launch", "main"]
