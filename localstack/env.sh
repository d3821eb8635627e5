# Source me: points the AWS SDK, the fifobox tools and the aws CLI at the
# local emulator, LocalStack or Floci, all of which serve the AWS API on :4566.
export AWS_ENDPOINT_URL="${AWS_ENDPOINT_URL:-http://127.0.0.1:${FIFOBOX_EMULATOR_PORT:-4566}}"
export AWS_REGION="${AWS_REGION:-us-east-1}"
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-$AWS_REGION}" # the aws CLI v1 reads only this one
export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-test}"
export AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-test}"
export AWS_PAGER="" # the aws CLI v2 would page JSON through less
# The aws CLI v2 reads AWS_ENDPOINT_URL; v1 ignores it for some services
# (sqs in us-east-1 goes to queue.amazonaws.com), so pass it explicitly.
aws() { command aws --endpoint-url "$AWS_ENDPOINT_URL" "$@"; }
