from quantlab.checkout import drop_checkout_root

drop_checkout_root()

from quantlab.cli import app  # noqa: E402

app(prog_name="quantlab")
