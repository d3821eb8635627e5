"""Runs a transfers client script unchanged against a local emulator.

Two differences between Debian's boto3 (1.26) and a current one matter
here, and this bridges both before running the script:
- boto3 reads AWS_ENDPOINT_URL itself only from 1.28 on: boto3.client gets
  it as its default endpoint_url.
- boto3 speaks SQS's JSON protocol from 1.34 on (AWS serves both); 1.26
  speaks the query protocol, which the fauxqs emulator does not. The SQS
  service model is switched to JSON as the newer model has it: same
  operations and shapes, JSON wire names.
Usage: python3 -u run.py <script.py>
"""
import os
import runpy
import sys

import boto3

boto3.setup_default_session()
_loader = boto3.DEFAULT_SESSION._session.get_component('data_loader')
_load_service_model = _loader.load_service_model


def load_service_model(service_name, type_name, api_version=None):
    model = _load_service_model(service_name, type_name, api_version)
    if service_name == 'sqs' and type_name == 'service-2' and model['metadata'].get('protocol') == 'query':
        model['metadata'].update(protocol='json', jsonVersion='1.0', targetPrefix='AmazonSQS')
        for shape in model['shapes'].values():
            shape.pop('flattened', None)
            for member in shape.get('members', {}).values():
                member.pop('locationName', None)
                member.pop('flattened', None)
            for part in ('member', 'key', 'value'):
                if isinstance(shape.get(part), dict):
                    shape[part].pop('locationName', None)
    return model


_loader.load_service_model = load_service_model
_client = boto3.client


def client(*args, **kwargs):
    if os.environ.get('AWS_ENDPOINT_URL'):
        kwargs.setdefault('endpoint_url', os.environ['AWS_ENDPOINT_URL'])
    return _client(*args, **kwargs)


boto3.client = client
runpy.run_path(sys.argv[1], run_name='__main__')
