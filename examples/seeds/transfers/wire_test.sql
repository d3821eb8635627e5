CREATE TABLE IF NOT EXISTS outbox (
  id uuid PRIMARY KEY,
  eventType text NOT NULL,
  payload jsonb NOT NULL,
  state text NOT NULL DEFAULT 'PENDING',
  attempts int NOT NULL DEFAULT 0,
  lastError text,
  next_attempt timestamptz NOT NULL DEFAULT now(),
  createdAt timestamptz NOT NULL DEFAULT now(),
  updatedAt timestamptz NOT NULL DEFAULT now()
);

-- Insert a fake submitted.usdc event
INSERT INTO outbox (id, eventType, payload)
VALUES (
  gen_random_uuid(),
  'events.transfers.submitted.usdc',
  jsonb_build_object(
    'envelope', jsonb_build_object('v',1,'eventId', gen_random_uuid()::text, 'occurredAt', now(), 'tenantId','tnt_demo','type','events.transfers.submitted.usdc'),
    'key', jsonb_build_object('transferId','tr_test_123'),
    'payload', jsonb_build_object('amount', jsonb_build_object('value','10.00','currency','USD'))
  )
);
