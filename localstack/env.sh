# Source me: points the AWS SDK (and the fifobox tools) at the local emulator,
# LocalStack or Floci, all of which serve the AWS API on :4566.
export AWS_ENDPOINT_URL="${AWS_ENDPOINT_URL:-http://127.0.0.1:${FIFOBOX_EMULATOR_PORT:-4566}}"
export AWS_REGION="${AWS_REGION:-us-east-1}"
export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-test}"
export AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-test}"
