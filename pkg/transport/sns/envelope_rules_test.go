package sns_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// What the producer accepts, the consumer reads: envelopes at each limit go
// through outbox.Enqueue and the stored body is applied by the handler;
// envelopes past a limit are refused at Enqueue with a *ValidationError
// naming the field (year 300000 used to fail at INSERT with an untyped SQL
// error; a null payload, a too-deep payload and invalid UTF-8 used to be
// accepted and then rejected by every consumer), and nothing is written.
func TestEnqueuedEnvelopesAreReadableByTheConsumer(t *testing.T) {
	t.Parallel()
	db := newDB(t)
	ctx := context.Background()
	edit := func(f func(*envelope.Envelope)) envelope.Envelope {
		e := ev("edge", 0)
		f(&e)
		return e
	}
	accepted := []envelope.Envelope{
		edit(func(e *envelope.Envelope) {
			e.Payload = json.RawMessage(strings.Repeat("[", envelope.MaxPayloadDepth) + strings.Repeat("]", envelope.MaxPayloadDepth))
		}),
		edit(func(e *envelope.Envelope) { e.OccurredAt = time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC) }),
		edit(func(e *envelope.Envelope) {
			e.Payload = json.RawMessage(`{"html":"<a>&</a>","emoji":"\ud83d\ude00","max":1e308}`)
		}),
		edit(func(e *envelope.Envelope) { e.TenantID = "m\u00fcller-\u6771\u4eac" }),
	}
	refused := []struct {
		e     envelope.Envelope
		field string
	}{
		{edit(func(e *envelope.Envelope) { e.OccurredAt = time.Date(300000, 1, 1, 0, 0, 0, 0, time.UTC) }), "occurred_at"},
		{edit(func(e *envelope.Envelope) { e.Payload = json.RawMessage(`null`) }), "payload"},
		{edit(func(e *envelope.Envelope) {
			e.Payload = json.RawMessage(strings.Repeat("[", 10000) + strings.Repeat("]", 10000))
		}), "payload"},
		{edit(func(e *envelope.Envelope) { e.Payload = json.RawMessage("{\"a\":\"\xff\"}") }), "payload"},
		{edit(func(e *envelope.Envelope) { e.Payload = json.RawMessage(`{"a":1,"a":2}`) }), "payload"},
	}
	for _, c := range refused {
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, c.e) })
		var ve *envelope.ValidationError
		if !errors.As(err, &ve) || ve.Field != c.field {
			t.Fatalf("Enqueue = %v, want a *ValidationError naming %s", err, c.field)
		}
	}
	for _, e := range accepted {
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, e) }); err != nil {
			t.Fatalf("Enqueue: %v", err)
		}
	}
	rows, err := db.Pool.Query(ctx, `SELECT body FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	bodies, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	if err != nil || len(bodies) != len(accepted) {
		t.Fatalf("%d rows in the outbox (%v), want %d", len(bodies), err, len(accepted))
	}
	h, _ := sns.NewHandler(db.Pool, &fakeDLQ{}, testApply, sns.HandlerConfig{Consumer: "c", DLQURL: "d"})
	var batch events.SQSEvent
	for i, b := range bodies {
		batch.Records = append(batch.Records, events.SQSMessage{MessageId: string(rune('a' + i)), Body: string(b), Attributes: map[string]string{"MessageGroupId": "edge"}})
	}
	if f := handle(t, h, batch.Records...); len(f) != 0 {
		t.Fatalf("the consumer failed %v", f)
	}
	for _, e := range accepted {
		if countEffects(t, db, e.ID) != 1 {
			t.Fatalf("event %s not applied", e.ID)
		}
	}
}
