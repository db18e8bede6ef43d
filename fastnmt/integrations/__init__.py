"""Optional integrations with other libraries; importing ``fastnmt`` never imports them."""
