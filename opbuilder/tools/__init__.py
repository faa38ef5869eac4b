"""Commands standing on the runtime (cli, report, scaffold, demo, bench); the runtime never imports them."""
