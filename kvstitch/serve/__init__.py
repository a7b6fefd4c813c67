"""The OpenAI-compatible server (`server`: the FastAPI app) and its parts: the body validated into the engine's
request (`schema`) and what it leaves out (`defaults`), the chat service (`chat`), the batching scheduler
(`worker`), the K/V admission budget (`admission`), stop strings (`stops`), /metrics (`prometheus`), what they
share (`core`), the document API (`documents`), authentication and binding (`security`), the TOML
configuration (`config`), a server in a background thread (`testing`)."""
