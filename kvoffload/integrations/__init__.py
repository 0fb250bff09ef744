"""Engine integrations; each lives behind its optional extra and the core never imports them."""
