# The transfers design's "Consumer mock (Python)" (seeds/004, Wire Test,
# step 4), as written. internal/seeds runs it against fifobox through
# run.py, which only points boto3 at the local emulator.
import os, json, boto3, datetime

sqs = boto3.client('sqs', region_name=os.environ.get('AWS_REGION','us-east-1'))
QUEUE_URL = os.environ['QUEUE_URL']

while True:
    resp = sqs.receive_message(QueueUrl=QUEUE_URL, MaxNumberOfMessages=1, WaitTimeSeconds=10)
    for m in resp.get('Messages', []):
        body = json.loads(m['Body'])
        payload = json.loads(body.get('Message', '{}'))
        evt = payload.get('envelope', {})
        print('Got event', evt.get('type'), evt.get('eventId'), datetime.datetime.utcnow().isoformat())
        # TODO: dedupe check by eventId in inbox table
        sqs.delete_message(QueueUrl=QUEUE_URL, ReceiptHandle=m['ReceiptHandle'])
