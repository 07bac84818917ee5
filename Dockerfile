# One Dockerfile for every Strata service. The engine's image installs the `gpu` extra (torch from
# PyPI: the CUDA build on x86_64, and the Triton kernels); the tokenizer, router and gateway images
# leave torch out.
#   docker build -t strata:cpu .
#   docker build -t strata:gpu --build-arg EXTRAS="[gpu]" .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
ARG EXTRAS=""
RUN pip install ".${EXTRAS}"

# Each service is a `strata` subcommand: docker run strata:cpu gateway --help
ENTRYPOINT ["strata"]
CMD ["--help"]
