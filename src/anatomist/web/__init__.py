"""`anatomist serve`: the estimate, the plan and their files on a page (the optional `web` extra).

Layout, one job per file:

- `service.py`: every call into anatomist (the CLI's own `build_estimate` / `build_plan`, the
  report's charts, `plan.emit`): the one file to adapt when the library changes;
- `fields.py`: the page's fields, generated from the Recipe dataclass and the CLI's options;
- `form.py`: the page's query checked against them, and the CLI's request (`cli.requests`) and
  command line it means;
- `uploads.py`: uploaded config.json and recipe files, size-limited, parsed (never executed);
- `jobs.py`: one worker thread runs estimates and plans, the page polls a job's progress;
- `capture.py`: what a job prints on stderr (the CLI's notes) kept for that job's page;
- `app.py`: the Starlette routes; `server.py`: uvicorn on a socket, the URL printed;
- `hf_space.py`: the folder that runs the same page as a Hugging Face Space.

This package imports nothing heavy at import time: `anatomist serve` says which extra is missing
before anything else is loaded (`server.require_extra`).
"""
