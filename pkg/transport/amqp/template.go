package amqp

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// Template fields, written {name} in a routing key or header template.
var templateFields = map[string]func(m *outbox.Message) string{
	"event_id":       func(m *outbox.Message) string { return m.EventID },
	"event_type":     func(m *outbox.Message) string { return m.EventType },
	"aggregate_type": func(m *outbox.Message) string { return m.AggregateType },
	"aggregate_id":   func(m *outbox.Message) string { return m.GroupID },
	"sequence":       func(m *outbox.Message) string { return strconv.FormatInt(m.Sequence, 10) },
	"tenant_id":      func(m *outbox.Message) string { return m.Attributes[envelope.AttrTenantID] },
	"traceparent":    func(m *outbox.Message) string { return m.Attributes[envelope.AttrTraceparent] },
}

// template is a parsed routing key or header template: literal text and
// {field} references, rendered without allocation beyond the result.
type template struct {
	parts []templatePart
}

type templatePart struct {
	lit   string
	field func(m *outbox.Message) string
}

// parseTemplate parses s, e.g. "{aggregate_type}.{event_type}".
func parseTemplate(s string) (template, error) {
	var t template
	for len(s) > 0 {
		i := strings.IndexByte(s, '{')
		if i < 0 {
			if strings.IndexByte(s, '}') >= 0 {
				return template{}, fmt.Errorf("unmatched '}' in %q", s)
			}
			t.parts = append(t.parts, templatePart{lit: s})
			break
		}
		if i > 0 {
			if strings.IndexByte(s[:i], '}') >= 0 {
				return template{}, fmt.Errorf("unmatched '}' in %q", s)
			}
			t.parts = append(t.parts, templatePart{lit: s[:i]})
		}
		j := strings.IndexByte(s[i:], '}')
		if j < 0 {
			return template{}, fmt.Errorf("unclosed '{' in %q", s)
		}
		name := s[i+1 : i+j]
		f, ok := templateFields[name]
		if !ok {
			return template{}, fmt.Errorf("unknown field {%s}: use one of %s", name, fieldNames())
		}
		t.parts = append(t.parts, templatePart{field: f})
		s = s[i+j+1:]
	}
	return t, nil
}

func fieldNames() string {
	return "{event_id} {event_type} {aggregate_type} {aggregate_id} {sequence} {tenant_id} {traceparent}"
}

// render fills the template from m. A template made of one field whose value
// is empty renders empty, so optional headers can be left out.
func (t template) render(m *outbox.Message) string {
	if len(t.parts) == 1 {
		if p := t.parts[0]; p.field != nil {
			return p.field(m)
		}
		return t.parts[0].lit
	}
	var b strings.Builder
	for _, p := range t.parts {
		if p.field != nil {
			b.WriteString(p.field(m))
		} else {
			b.WriteString(p.lit)
		}
	}
	return b.String()
}
