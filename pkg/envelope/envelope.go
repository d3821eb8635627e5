package envelope

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Version is the envelope format version written by Encode and required by Decode.
const Version = 1

// DefaultMaxMessageBytes is the SNS publish limit for one message, body plus
// message attributes (256 KiB).
const DefaultMaxMessageBytes = 262144

// Message attribute names set on every published message. They are what SQS
// subscription filter policies match on; raw delivery carries at most 10.
const (
	AttrEventType     = "event_type"
	AttrAggregateType = "aggregate_type"
	AttrTenantID      = "tenant_id"
	AttrTraceparent   = "traceparent"
)

// attrDataType is the SNS data type of every attribute; it counts toward the size.
const attrDataType = "String"

// Envelope is one event: who it is about (the aggregate), what happened (the
// type and JSON payload) and how it relates to other events (correlation,
// causation, trace context).
type Envelope struct {
	// ID identifies the event; a UUID. It is also the SNS deduplication id and
	// the consumer inbox key.
	ID string `json:"id"`
	// Type names what happened, e.g. "order.created".
	Type string `json:"type"`
	// OccurredAt is when the business fact happened (UTC).
	OccurredAt time.Time `json:"occurred_at"`
	// AggregateType and AggregateID name the entity the event belongs to. The
	// aggregate id is the SNS FIFO message group: events of one aggregate are
	// delivered in order.
	AggregateType string `json:"aggregate_type"`
	AggregateID   string `json:"aggregate_id"`
	// Sequence is the event's position within its aggregate, assigned by the
	// outbox at enqueue (1, 2, 3...). Zero before enqueue.
	Sequence int64 `json:"sequence,omitempty"`
	// TenantID is optional; it is exposed as a message attribute for filtering.
	TenantID string `json:"tenant_id,omitempty"`
	// CorrelationID groups all events of one business flow; optional.
	CorrelationID string `json:"correlation_id,omitempty"`
	// CausationID is the id of the event or command that caused this one; optional.
	CausationID string `json:"causation_id,omitempty"`
	// TraceParent and TraceState carry W3C trace context; optional.
	TraceParent string `json:"traceparent,omitempty"`
	TraceState  string `json:"tracestate,omitempty"`
	// SchemaVersion is the version of the payload's schema for this Type; >= 1.
	SchemaVersion int `json:"schema_version"`
	// Payload is the event body, any JSON value.
	Payload json.RawMessage `json:"payload"`
}

// New returns an envelope with a fresh time-ordered id (UUIDv7), OccurredAt
// set to now and schema version 1; payload is marshalled to JSON and must
// meet the payload rules (a nil payload marshals to null: use struct{}{}).
func New(eventType, aggregateType, aggregateID string, payload any) (Envelope, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return Envelope{}, fmt.Errorf("new event id: %w", err)
	}
	raw, err := json.Marshal(payload)
	if err != nil {
		return Envelope{}, &ValidationError{Field: "payload", Kind: ErrInvalid, Reason: err.Error()}
	}
	if err := checkPayload(raw); err != nil {
		return Envelope{}, err // e.g. a nil payload, which is JSON null
	}
	return Envelope{
		ID:            id.String(),
		Type:          eventType,
		OccurredAt:    time.Now().UTC(),
		AggregateType: aggregateType,
		AggregateID:   aggregateID,
		SchemaVersion: 1,
		Payload:       raw,
	}, nil
}

// Validate checks every field and the size against DefaultMaxMessageBytes.
func (e Envelope) Validate() error { return e.ValidateWithLimit(DefaultMaxMessageBytes) }

// ValidateWithLimit checks every field and that the published message (body
// plus attributes) fits in maxMessageBytes. It returns the first problem found
// as a *ValidationError.
func (e Envelope) ValidateWithLimit(maxMessageBytes int) error {
	if err := e.validateFields(); err != nil {
		return err
	}
	// Size the message as it will be published. If the sequence is not assigned
	// yet, assume the widest one so enqueue never accepts an event that grows
	// past the limit when the outbox numbers it.
	sized := e
	if sized.Sequence == 0 {
		sized.Sequence = math.MaxInt64
	}
	n, err := sized.MessageSize()
	if err != nil {
		return err
	}
	if n > maxMessageBytes {
		return &ValidationError{Field: "payload", Kind: ErrTooLarge,
			Reason: fmt.Sprintf("message would be %d bytes, limit is %d", n, maxMessageBytes)}
	}
	return nil
}

func (e Envelope) validateFields() error {
	if e.ID == "" {
		return missing("id")
	}
	if len(e.ID) != 36 {
		return invalid("id", "must be a UUID in canonical 8-4-4-4-12 form")
	}
	if _, err := uuid.Parse(e.ID); err != nil {
		return invalid("id", "must be a UUID in canonical 8-4-4-4-12 form")
	}
	if err := checkName("type", e.Type, MaxTypeLen, true); err != nil {
		return err
	}
	if err := checkOccurredAt(e); err != nil {
		return err
	}
	if err := checkName("aggregate_type", e.AggregateType, MaxAggregateTypeLen, true); err != nil {
		return err
	}
	if err := CheckGroupID("aggregate_id", e.AggregateID); err != nil {
		return err
	}
	if e.Sequence < 0 {
		return invalid("sequence", "must not be negative")
	}
	if err := checkText("tenant_id", e.TenantID, MaxTenantIDLen); err != nil {
		return err
	}
	if e.CorrelationID != "" {
		if err := CheckGroupID("correlation_id", e.CorrelationID); err != nil {
			return err
		}
	}
	if e.CausationID != "" {
		if err := CheckGroupID("causation_id", e.CausationID); err != nil {
			return err
		}
	}
	if e.TraceParent != "" {
		ctx := propagator.Extract(context.Background(), propagation.MapCarrier{"traceparent": e.TraceParent})
		if !trace.SpanContextFromContext(ctx).IsValid() {
			return invalid("traceparent", "must be a W3C traceparent (00-<trace-id>-<span-id>-<flags>)")
		}
	}
	if e.TraceState != "" {
		if e.TraceParent == "" {
			return invalid("tracestate", "set without traceparent")
		}
		if _, err := trace.ParseTraceState(e.TraceState); err != nil {
			return invalid("tracestate", "must be a W3C tracestate")
		}
	}
	if e.SchemaVersion < 1 || e.SchemaVersion > MaxSchemaVersion {
		return invalid("schema_version", "must be 1 to %d", MaxSchemaVersion)
	}
	return checkPayload(e.Payload)
}

// CheckGroupID validates a value that SNS FIFO uses as a MessageGroupId or
// MessageDeduplicationId: 1-128 characters, each alphanumeric or ASCII
// punctuation. AWS rejects anything else; some emulators do not, so fifobox
// checks it itself.
func CheckGroupID(field, v string) error {
	if v == "" {
		return missing(field)
	}
	if len(v) > MaxGroupIDLen {
		return invalid(field, "is %d characters, at most %d allowed", len(v), MaxGroupIDLen)
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < '!' || c > '~' {
			return invalid(field, "character at offset %d is not alphanumeric or punctuation", i)
		}
	}
	return nil
}

// checkName allows the characters that are safe in attribute values and
// filter policies: letters, digits and . _ - : /
func checkName(field, v string, max int, required bool) error {
	if v == "" {
		if required {
			return missing(field)
		}
		return nil
	}
	if len(v) > max {
		return invalid(field, "is %d characters, at most %d allowed", len(v), max)
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("._-:/", c) >= 0
		if !ok {
			return invalid(field, "character at offset %d is not a letter, digit or one of . _ - : /", i)
		}
	}
	return nil
}

// checkText allows any printable UTF-8 without control characters.
func checkText(field, v string, max int) error {
	if v == "" {
		return nil
	}
	if !utf8.ValidString(v) {
		return invalid(field, "is not valid UTF-8")
	}
	if utf8.RuneCountInString(v) > max {
		return invalid(field, "is longer than %d characters", max)
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f {
			return invalid(field, "contains a control character")
		}
	}
	return nil
}

// Attributes returns the SNS message attributes for e (all of type String).
// Empty optional values are left out.
func (e Envelope) Attributes() map[string]string {
	a := map[string]string{
		AttrEventType:     e.Type,
		AttrAggregateType: e.AggregateType,
	}
	if e.TenantID != "" {
		a[AttrTenantID] = e.TenantID
	}
	if e.TraceParent != "" {
		a[AttrTraceparent] = e.TraceParent
	}
	return a
}

// MessageSize is the size SNS counts for the published message: the encoded
// body plus, per attribute, its name, data type and value.
func (e Envelope) MessageSize() (int, error) {
	body, err := e.Encode()
	if err != nil {
		return 0, err
	}
	return len(body) + AttributesSize(e.Attributes()), nil
}

// AttributesSize is the number of bytes SNS counts for message attributes.
func AttributesSize(attrs map[string]string) int {
	n := 0
	for k, v := range attrs {
		n += len(k) + len(attrDataType) + len(v)
	}
	return n
}

// wire is the JSON layout; "v" comes first so readers can route by version.
type wire struct {
	V             int             `json:"v"`
	ID            string          `json:"id"`
	Type          string          `json:"type"`
	OccurredAt    string          `json:"occurred_at"`
	AggregateType string          `json:"aggregate_type"`
	AggregateID   string          `json:"aggregate_id"`
	Sequence      int64           `json:"sequence,omitempty"`
	TenantID      string          `json:"tenant_id,omitempty"`
	CorrelationID string          `json:"correlation_id,omitempty"`
	CausationID   string          `json:"causation_id,omitempty"`
	TraceParent   string          `json:"traceparent,omitempty"`
	TraceState    string          `json:"tracestate,omitempty"`
	SchemaVersion int             `json:"schema_version"`
	Payload       json.RawMessage `json:"payload"`
}

// Encode returns the JSON message body. The payload is compacted (its
// insignificant whitespace removed, nothing else changed); everything else
// is written exactly, without HTML escaping, so for an envelope Validate
// accepts, Decode(Encode(e)) equals e with the payload compacted and
// occurred_at in UTC.
func (e Envelope) Encode() ([]byte, error) {
	w := wire{
		V: Version, ID: e.ID, Type: e.Type,
		AggregateType: e.AggregateType, AggregateID: e.AggregateID, Sequence: e.Sequence,
		TenantID: e.TenantID, CorrelationID: e.CorrelationID, CausationID: e.CausationID,
		TraceParent: e.TraceParent, TraceState: e.TraceState,
		SchemaVersion: e.SchemaVersion, Payload: e.Payload,
	}
	if !e.OccurredAt.IsZero() {
		w.OccurredAt = e.OccurredAt.UTC().Format(time.RFC3339Nano)
	}
	if len(w.Payload) == 0 {
		w.Payload = json.RawMessage("null")
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(w); err != nil {
		return nil, &ValidationError{Field: "payload", Kind: ErrInvalid, Reason: "is not valid JSON"}
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// Decode parses and validates a message body written by Encode. Every failure
// is a *ValidationError naming the field ("envelope" for the document as a whole).
//
// Decoding is strict, so every consumer reads a message the same way,
// whatever its JSON library: the body must be valid UTF-8; member names
// match exactly (a member such as "ID" that differs from a field name only
// in case is an error naming that field, not a silent match); a member may
// not appear twice; the payload meets the same rules as in Validate.
// Unknown members are ignored, so newer producers do not break older
// consumers.
func Decode(body []byte) (Envelope, error) {
	if !utf8.Valid(body) {
		return Envelope{}, invalid("envelope", "is not valid UTF-8")
	}
	var w wire
	if err := decodeWire(body, &w); err != nil {
		return Envelope{}, err
	}
	if w.V != Version {
		return Envelope{}, invalid("v", "envelope version %d is not supported (want %d)", w.V, Version)
	}
	e := Envelope{
		ID: w.ID, Type: w.Type,
		AggregateType: w.AggregateType, AggregateID: w.AggregateID, Sequence: w.Sequence,
		TenantID: w.TenantID, CorrelationID: w.CorrelationID, CausationID: w.CausationID,
		TraceParent: w.TraceParent, TraceState: w.TraceState,
		SchemaVersion: w.SchemaVersion, Payload: w.Payload,
	}
	if w.OccurredAt != "" {
		t, err := time.Parse(time.RFC3339Nano, w.OccurredAt)
		if err != nil {
			return Envelope{}, invalid("occurred_at", "must be an RFC 3339 timestamp")
		}
		e.OccurredAt = t.UTC()
	}
	// A received message may exceed nothing we control; check fields only.
	if err := e.validateFields(); err != nil {
		return Envelope{}, err
	}
	return e, nil
}

// decodeWire reads the envelope object member by member: exact names, no
// duplicates, unknown members skipped.
func decodeWire(body []byte, w *wire) error {
	fields := map[string]any{
		"v": &w.V, "id": &w.ID, "type": &w.Type, "occurred_at": &w.OccurredAt,
		"aggregate_type": &w.AggregateType, "aggregate_id": &w.AggregateID, "sequence": &w.Sequence,
		"tenant_id": &w.TenantID, "correlation_id": &w.CorrelationID, "causation_id": &w.CausationID,
		"traceparent": &w.TraceParent, "tracestate": &w.TraceState,
		"schema_version": &w.SchemaVersion, "payload": &w.Payload,
	}
	notObject := invalid("envelope", "is not a JSON object")
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return notObject
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return notObject
		}
		name, _ := tok.(string)
		target, known := fields[name]
		if !known {
			for f := range fields {
				if strings.EqualFold(f, name) {
					return invalid(f, "member %q differs from the field name only in case", name)
				}
			}
		}
		if seen[name] {
			field := name
			if !known {
				field = "envelope"
			}
			return invalid(field, "appears twice")
		}
		seen[name] = true
		if !known {
			var skip json.RawMessage
			if err := dec.Decode(&skip); err != nil {
				return notObject
			}
			continue
		}
		if err := dec.Decode(target); err != nil {
			var te *json.UnmarshalTypeError
			if errors.As(err, &te) {
				return invalid(name, "has JSON type %s, want %s", te.Value, te.Type)
			}
			return notObject
		}
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return notObject
	}
	if _, err := dec.Token(); err != io.EOF {
		return invalid("envelope", "has data after the JSON object")
	}
	if bytes.Equal(w.Payload, []byte("null")) {
		w.Payload = nil // a JSON null payload is a missing one
	}
	return nil
}

var propagator = propagation.TraceContext{}

// InjectTrace sets TraceParent/TraceState from the span context in ctx (if any).
func (e *Envelope) InjectTrace(ctx context.Context) {
	c := propagation.MapCarrier{}
	propagator.Inject(ctx, c)
	e.TraceParent = c.Get("traceparent")
	e.TraceState = c.Get("tracestate")
}

// ContextWithTrace returns ctx carrying e's trace context as the remote parent,
// so a consumer's spans join the producer's trace.
func (e Envelope) ContextWithTrace(ctx context.Context) context.Context {
	if e.TraceParent == "" {
		return ctx
	}
	return propagator.Extract(ctx, propagation.MapCarrier{"traceparent": e.TraceParent, "tracestate": e.TraceState})
}
