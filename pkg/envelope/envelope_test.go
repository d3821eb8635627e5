package envelope_test

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/fifobox/fifobox/pkg/envelope"
)

func valid() envelope.Envelope {
	return envelope.Envelope{
		ID:            "0190f3a4-7c1e-7b2a-9f00-1234567890ab",
		Type:          "order.created",
		OccurredAt:    time.Date(2026, 11, 22, 10, 0, 0, 123456789, time.UTC),
		AggregateType: "order",
		AggregateID:   "order-42",
		Sequence:      3,
		TenantID:      "acme",
		CorrelationID: "corr-1",
		CausationID:   "cause-1",
		TraceParent:   "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		TraceState:    "vendor=abc",
		SchemaVersion: 2,
		Payload:       json.RawMessage(`{"amount_cents":1200,"currency":"EUR"}`),
	}
}

func TestValidateRejectsBadFields(t *testing.T) {
	t.Parallel()
	big := `{"x":"` + strings.Repeat("a", envelope.DefaultMaxMessageBytes) + `"}`
	cases := []struct {
		name  string
		edit  func(*envelope.Envelope)
		field string
		kind  error
	}{
		{"missing id", func(e *envelope.Envelope) { e.ID = "" }, "id", envelope.ErrMissing},
		{"id not uuid", func(e *envelope.Envelope) { e.ID = "not-a-uuid-not-a-uuid-not-a-uuid-123" }, "id", envelope.ErrInvalid},
		{"id braces", func(e *envelope.Envelope) { e.ID = "{0190f3a4-7c1e-7b2a-9f00-1234567890ab}" }, "id", envelope.ErrInvalid},
		{"missing type", func(e *envelope.Envelope) { e.Type = "" }, "type", envelope.ErrMissing},
		{"type with space", func(e *envelope.Envelope) { e.Type = "order created" }, "type", envelope.ErrInvalid},
		{"missing occurred_at", func(e *envelope.Envelope) { e.OccurredAt = time.Time{} }, "occurred_at", envelope.ErrMissing},
		{"missing aggregate_type", func(e *envelope.Envelope) { e.AggregateType = "" }, "aggregate_type", envelope.ErrMissing},
		{"missing aggregate_id", func(e *envelope.Envelope) { e.AggregateID = "" }, "aggregate_id", envelope.ErrMissing},
		{"group id with space", func(e *envelope.Envelope) { e.AggregateID = "order 42" }, "aggregate_id", envelope.ErrInvalid},
		{"group id non-ascii", func(e *envelope.Envelope) { e.AggregateID = "bestellung-ä" }, "aggregate_id", envelope.ErrInvalid},
		{"group id 129 chars", func(e *envelope.Envelope) { e.AggregateID = strings.Repeat("a", 129) }, "aggregate_id", envelope.ErrInvalid},
		{"negative sequence", func(e *envelope.Envelope) { e.Sequence = -1 }, "sequence", envelope.ErrInvalid},
		{"tenant control char", func(e *envelope.Envelope) { e.TenantID = "a\nb" }, "tenant_id", envelope.ErrInvalid},
		{"correlation with space", func(e *envelope.Envelope) { e.CorrelationID = "a b" }, "correlation_id", envelope.ErrInvalid},
		{"causation too long", func(e *envelope.Envelope) { e.CausationID = strings.Repeat("c", 200) }, "causation_id", envelope.ErrInvalid},
		{"bad traceparent", func(e *envelope.Envelope) { e.TraceParent = "00-xyz-01" }, "traceparent", envelope.ErrInvalid},
		{"zero trace id", func(e *envelope.Envelope) {
			e.TraceParent = "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
		}, "traceparent", envelope.ErrInvalid},
		{"tracestate alone", func(e *envelope.Envelope) { e.TraceParent = "" }, "tracestate", envelope.ErrInvalid},
		{"schema version 0", func(e *envelope.Envelope) { e.SchemaVersion = 0 }, "schema_version", envelope.ErrInvalid},
		{"missing payload", func(e *envelope.Envelope) { e.Payload = nil }, "payload", envelope.ErrMissing},
		{"payload not json", func(e *envelope.Envelope) { e.Payload = json.RawMessage(`{"a":`) }, "payload", envelope.ErrInvalid},
		{"payload too large", func(e *envelope.Envelope) { e.Payload = json.RawMessage(big) }, "payload", envelope.ErrTooLarge},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := valid()
			tc.edit(&e)
			err := e.Validate()
			var ve *envelope.ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("Validate() = %v, want *ValidationError", err)
			}
			if ve.Field != tc.field {
				t.Errorf("Field = %q, want %q (err: %v)", ve.Field, tc.field, err)
			}
			if !errors.Is(err, tc.kind) {
				t.Errorf("errors.Is(err, %v) = false; err = %v", tc.kind, err)
			}
			if !strings.Contains(err.Error(), tc.field) {
				t.Errorf("message %q does not name the field", err.Error())
			}
		})
	}
}

func TestValidAccepted(t *testing.T) {
	t.Parallel()
	if err := valid().Validate(); err != nil {
		t.Fatal(err)
	}
	// Punctuation is allowed in group ids, as SNS allows it.
	e := valid()
	e.AggregateID = `a!"#$%&'()*+,-./:;<=>?@[\]^_` + "`{|}~z"
	if err := e.Validate(); err != nil {
		t.Fatalf("punctuation group id: %v", err)
	}
}

func TestSizeLimitIsConfigurableAndCountsAttributes(t *testing.T) {
	t.Parallel()
	e := valid()
	e.Sequence = 0
	n, err := e.MessageSize()
	if err != nil {
		t.Fatal(err)
	}
	body, _ := e.Encode()
	if n <= len(body) {
		t.Fatalf("MessageSize %d should exceed body %d (attributes count)", n, len(body))
	}
	// Unsequenced events are sized with the widest sequence (19 digits + key).
	if err := e.ValidateWithLimit(n + 40); err != nil {
		t.Fatalf("limit n+40: %v", err)
	}
	if err := e.ValidateWithLimit(n); !errors.Is(err, envelope.ErrTooLarge) {
		t.Fatalf("limit n: got %v, want ErrTooLarge", err)
	}
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	t.Parallel()
	in := valid()
	b, err := in.Encode()
	if err != nil {
		t.Fatal(err)
	}
	out, err := envelope.Decode(b)
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	if !out.OccurredAt.Equal(in.OccurredAt) {
		t.Fatalf("occurred_at %v != %v", out.OccurredAt, in.OccurredAt)
	}
	if !reflect.DeepEqual(in, out) {
		t.Fatalf("round trip mismatch:\n in=%+v\nout=%+v", in, out)
	}
	b2, _ := out.Encode()
	if string(b) != string(b2) {
		t.Fatalf("re-encode differs:\n%s\n%s", b, b2)
	}
	if !strings.HasPrefix(string(b), `{"v":1,`) {
		t.Fatalf("encoding should start with the version: %s", b)
	}
}

func TestDecodeErrorsNameTheField(t *testing.T) {
	t.Parallel()
	good, _ := valid().Encode()
	cases := []struct {
		name, body, field string
	}{
		{"not json", `nope`, "envelope"},
		{"array", `[1]`, "envelope"},
		{"wrong version", strings.Replace(string(good), `"v":1`, `"v":2`, 1), "v"},
		{"sequence as string", strings.Replace(string(good), `"sequence":3`, `"sequence":"3"`, 1), "sequence"},
		{"bad time", strings.Replace(string(good), `"occurred_at":"2026-11-22T10:00:00.123456789Z"`, `"occurred_at":"yesterday"`, 1), "occurred_at"},
		{"missing payload", strings.Replace(string(good), `"payload":{"amount_cents":1200,"currency":"EUR"}`, `"payload":null`, 1), "payload"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := envelope.Decode([]byte(tc.body))
			var ve *envelope.ValidationError
			if !errors.As(err, &ve) || ve.Field != tc.field {
				t.Fatalf("Decode = %v, want field %q", err, tc.field)
			}
		})
	}
}

func TestTraceContextPropagation(t *testing.T) {
	t.Parallel()
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)

	e := valid()
	e.TraceParent, e.TraceState = "", ""
	e.InjectTrace(ctx)
	if e.TraceParent != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" {
		t.Fatalf("traceparent = %q", e.TraceParent)
	}
	if err := e.Validate(); err != nil {
		t.Fatal(err)
	}
	got := trace.SpanContextFromContext(e.ContextWithTrace(context.Background()))
	if got.TraceID() != tid || got.SpanID() != sid || !got.IsRemote() {
		t.Fatalf("extracted %v", got)
	}
	// No span: nothing injected, still valid.
	e.InjectTrace(context.Background())
	if e.TraceParent != "" {
		t.Fatalf("traceparent without span = %q", e.TraceParent)
	}
}

func TestNew(t *testing.T) {
	t.Parallel()
	e, err := envelope.New("order.paid", "order", "o-1", map[string]int{"amount_cents": 5})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := envelope.New("t", "a", "b", make(chan int)); !envelope.IsValidation(err) {
		t.Fatalf("unmarshalable payload: %v", err)
	}
}

func FuzzDecode(f *testing.F) {
	good, _ := valid().Encode()
	f.Add(good)
	f.Add([]byte(`{"v":1}`))
	f.Add([]byte(`{"v":1,"id":"0190f3a4-7c1e-7b2a-9f00-1234567890ab","payload":[1,2]}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, body []byte) {
		e, err := envelope.Decode(body)
		if err != nil {
			if !envelope.IsValidation(err) {
				t.Fatalf("Decode error is not a *ValidationError: %v", err)
			}
			return
		}
		// Anything accepted must re-encode and decode to the same envelope.
		b, err := e.Encode()
		if err != nil {
			t.Fatalf("Encode after Decode: %v", err)
		}
		e2, err := envelope.Decode(b)
		if err != nil {
			t.Fatalf("Decode(Encode(e)): %v", err)
		}
		b2, _ := e2.Encode()
		if string(b) != string(b2) {
			t.Fatalf("not stable:\n%s\n%s", b, b2)
		}
	})
}
