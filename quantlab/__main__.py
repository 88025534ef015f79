from quantlab.cli import app

app(prog_name="quantlab")
