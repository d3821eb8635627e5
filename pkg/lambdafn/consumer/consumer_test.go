package consumer_test

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/lambdafn/consumer"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/readmodel"
)

func TestConfigFromEnv(t *testing.T) {
	tests := []struct {
		name, consumer, dlq, wantErr string
		env                          map[string]string
	}{
		{"ok", "orders-projection", "http://q/dlq", "", nil},
		{"no name", "", "http://q/dlq", "FIFOBOX_CONSUMER_NAME", nil},
		{"no dlq", "orders-projection", "", "FIFOBOX_DLQ_URL", nil},
		{"relaxed", "c", "d", "", map[string]string{"FIFOBOX_CONSUMER_ORDER": "relaxed", "FIFOBOX_MAX_RECEIVE_COUNT": "5",
			"FIFOBOX_DEADLINE_MARGIN": "2s", "FIFOBOX_LOG_AGGREGATE_IDS": "true"}},
		{"bad order", "c", "d", "FIFOBOX_CONSUMER_ORDER", map[string]string{"FIFOBOX_CONSUMER_ORDER": "loose"}},
		{"bad max receive", "c", "d", "FIFOBOX_MAX_RECEIVE_COUNT", map[string]string{"FIFOBOX_MAX_RECEIVE_COUNT": "0"}},
		{"bad margin", "c", "d", "FIFOBOX_DEADLINE_MARGIN", map[string]string{"FIFOBOX_DEADLINE_MARGIN": "soon"}},
		{"bad log flag", "c", "d", "FIFOBOX_LOG_AGGREGATE_IDS", map[string]string{"FIFOBOX_LOG_AGGREGATE_IDS": "maybe"}},
		{"rabbitmq needs no dlq url", "c", "", "", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq"}},
		{"rabbitmq refuses a dlq url", "c", "d", "FIFOBOX_DLQ_URL", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq"}},
		{"nats has no event source", "c", "", "FIFOBOX_TRANSPORT", map[string]string{"FIFOBOX_TRANSPORT": "nats"}},
		{"unknown transport", "c", "d", "FIFOBOX_TRANSPORT", map[string]string{"FIFOBOX_TRANSPORT": "kafka"}},
		{"sns names both", "c", "", "FIFOBOX_TRANSPORT=sns", map[string]string{"FIFOBOX_TRANSPORT": "sns"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("FIFOBOX_CONSUMER_NAME", tt.consumer)
			t.Setenv("FIFOBOX_DLQ_URL", tt.dlq)
			for _, k := range []string{"FIFOBOX_CONSUMER_ORDER", "FIFOBOX_MAX_RECEIVE_COUNT", "FIFOBOX_DEADLINE_MARGIN", "FIFOBOX_LOG_AGGREGATE_IDS", "FIFOBOX_TRANSPORT"} {
				t.Setenv(k, tt.env[k])
			}
			_, err := consumer.ConfigFromEnv()
			if tt.wantErr == "" && err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("error = %v, want one naming %s", err, tt.wantErr)
			}
		})
	}
}

type dlq struct {
	mu   sync.Mutex
	sent int
}

func (d *dlq) SendMessage(context.Context, *sqs.SendMessageInput, ...func(*sqs.Options)) (*sqs.SendMessageOutput, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sent++
	return &sqs.SendMessageOutput{MessageId: aws.String("m")}, nil
}

func record(t *testing.T, id string, e envelope.Envelope) events.SQSMessage {
	t.Helper()
	body, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return events.SQSMessage{MessageId: id, Body: string(body),
		Attributes: map[string]string{"MessageGroupId": e.AggregateID, "ApproximateReceiveCount": "1"}}
}

// The wired handler applies the read model once per event, acknowledges an
// invalid record by dead-lettering it, and writes one valid EMF line per batch.
func TestOrdersProjectionBatch(t *testing.T) {
	db := pgtest.New(t)
	var out bytes.Buffer
	d := &dlq{}
	h, err := consumer.New(db.Pool, d, readmodel.ForConsumer("orders-projection"), metrics.New(&out, ""),
		consumer.Config{Consumer: "orders-projection", DLQURL: "http://dlq"})
	if err != nil {
		t.Fatal(err)
	}
	created, _ := envelope.New("order.created", "order", "o-1", readmodel.OrderEvent{OrderID: "o-1", AmountCents: 500, Currency: "EUR"})
	created.Sequence = 1
	paid, _ := envelope.New("order.paid", "order", "o-1", readmodel.OrderEvent{OrderID: "o-1"})
	paid.Sequence = 2
	batch := events.SQSEvent{Records: []events.SQSMessage{
		record(t, "1", created), record(t, "2", created), // delivered twice
		record(t, "3", paid),
		{MessageId: "4", Body: `{"v":1,"id":"not-a-uuid"}`, Attributes: map[string]string{"MessageGroupId": "o-2"}},
	}}
	resp, err := h.Handle(context.Background(), batch)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.BatchItemFailures) != 0 {
		t.Fatalf("failures = %+v, want none (the invalid record goes to the DLQ)", resp.BatchItemFailures)
	}
	var status string
	var count int
	if err := db.Pool.QueryRow(context.Background(), `SELECT status, event_count FROM orders_read_model WHERE order_id = 'o-1'`).Scan(&status, &count); err != nil {
		t.Fatal(err)
	}
	if status != "paid" || count != 2 {
		t.Fatalf("read model = %s/%d, want paid/2", status, count)
	}
	if d.sent != 1 {
		t.Fatalf("DLQ sends = %d, want 1", d.sent)
	}
	line := bytes.TrimSpace(out.Bytes())
	doc, err := metrics.Validate(line)
	if err != nil {
		t.Fatalf("EMF line invalid: %v\n%s", err, line)
	}
	if doc["Processed"] != float64(2) || doc["Duplicates"] != float64(1) || doc["Failures"] != float64(1) || doc["Consumer"] != "orders-projection" {
		t.Fatalf("metrics = %v", doc)
	}
}
