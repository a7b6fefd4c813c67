"""The OpenAI-compatible server (`server`: the FastAPI app) and its parts: the checked request (`schema`), the
chat service (`chat`), the batching scheduler (`worker`), the K/V admission budget (`admission`), stop strings
(`stops`), /metrics (`prometheus`), what they share (`core`), the document API (`documents`), authentication
and binding (`security`), the TOML configuration (`config`), a server in a background thread (`testing`)."""
