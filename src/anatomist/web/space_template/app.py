"""anatomist on a Hugging Face Space: `anatomist serve` on every interface, on the port the README's
`app_port` names. Hub ids may be typed unless the Space's variable ANATOMIST_ALLOW_NETWORK is 0."""

import os
import sys

from anatomist.cli import main

if __name__ == "__main__":
    network = [] if os.environ.get("ANATOMIST_ALLOW_NETWORK", "1") == "0" else ["--allow-network"]
    host, port = os.environ.get("HOST", "0.0.0.0"), os.environ.get("PORT", "7860")
    sys.exit(main(["serve", "--host", host, "--port", port, *network]))
