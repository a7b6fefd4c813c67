"""The OpenAI-compatible server (`server`) and its parts: what its routers share (`core`), the document API
(`documents`), authentication and binding (`security`), the TOML configuration (`config`)."""
