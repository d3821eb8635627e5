"""A consumer following the transfers design's consumer flowchart (seeds/004,
"Failure & Retry Semantics > Consumer"): seen before (inbox by eventId)?
ack; else handle the side effect; on success insert the inbox row and
ack; on failure throw and do not ack, so SQS retries and, after the
queue's maxReceiveCount, moves the message to the DLQ.

The side effect fails for every eventId in FAIL_EVENT_IDS (comma-separated).
Each applied event is printed as "applied <transferId> <eventId>".
"""
import json
import os

import boto3

sqs = boto3.client('sqs', region_name=os.environ.get('AWS_REGION', 'us-east-1'))
QUEUE_URL = os.environ['QUEUE_URL']
FAIL = set(filter(None, os.environ.get('FAIL_EVENT_IDS', '').split(',')))
inbox = set()  # the inbox table, by eventId


def handle(payload):
    if payload['envelope']['eventId'] in FAIL:
        raise RuntimeError('side effect failed')


print('ready', flush=True)
while True:
    resp = sqs.receive_message(QueueUrl=QUEUE_URL, MaxNumberOfMessages=1, WaitTimeSeconds=1)
    for m in resp.get('Messages', []):
        payload = json.loads(json.loads(m['Body'])['Message'])
        event_id = payload['envelope']['eventId']
        if event_id not in inbox:
            try:
                handle(payload)
            except RuntimeError:
                continue  # not acknowledged: SQS retries, then the DLQ
            inbox.add(event_id)
            print('applied', payload['key']['transferId'], event_id, flush=True)
        sqs.delete_message(QueueUrl=QUEUE_URL, ReceiptHandle=m['ReceiptHandle'])
