package wire

import (
	"encoding/json"
	"fmt"
	"regexp"
)

// header is one compiled header: a template, or a literal number or bool.
type header struct {
	name string
	tpl  template
	lit  any // int64, float64 or bool; nil for a template
}

// Header is one rendered header or message attribute. Value is a string,
// an int64 (a number field or literal), a float64 or a bool.
type Header struct {
	Name  string
	Value any
}

// compileHeaders compiles a profile's header map (in name order). nameRE
// checks names; reserved names are refused.
func compileHeaders(m map[string]any, at string, nameRE *regexp.Regexp, reserved func(string) bool) ([]header, []error) {
	var out []header
	var errs []error
	for _, name := range sortedKeys(m) {
		p := fmt.Sprintf("%s[%q]", at, name)
		if !nameRE.MatchString(name) {
			errs = append(errs, fmt.Errorf("%s: invalid header name (%s)", p, nameRE))
			continue
		}
		if reserved != nil && reserved(name) {
			errs = append(errs, fmt.Errorf("%s: reserved: the transport sets it", p))
			continue
		}
		switch v := m[name].(type) {
		case string:
			t, err := parseTemplate(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %v", p, err))
				continue
			}
			for _, r := range t.refs() {
				if r.f.name == "payload" && r.path == nil {
					errs = append(errs, fmt.Errorf("%s: {payload} is the whole payload; name a member, e.g. {payload.group_id}", p))
				}
			}
			out = append(out, header{name: name, tpl: t})
		case json.Number, bool:
			lit, err := normalize(v, p)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			out = append(out, header{name: name, lit: lit})
		default:
			errs = append(errs, fmt.Errorf("%s: a template string, a number or a bool", p))
		}
	}
	return out, errs
}

// render returns the headers for e. A header whose template is one field
// with an empty value is left out (an optional tenant, a null
// subsidiary); a template that is one number field is a number.
func renderHeaders(hs []header, e *event) ([]Header, error) {
	out := make([]Header, 0, len(hs))
	for _, h := range hs {
		if h.lit != nil {
			out = append(out, Header{Name: h.name, Value: h.lit})
			continue
		}
		if p, ok := h.tpl.single(); ok {
			v, err := p.resolve(e)
			if err != nil {
				return nil, err
			}
			switch {
			case v.empty():
			case v.k == kindInt:
				out = append(out, Header{Name: h.name, Value: v.n})
			default:
				out = append(out, Header{Name: h.name, Value: v.text()})
			}
			continue
		}
		s, err := h.tpl.render(e)
		if err != nil {
			return nil, err
		}
		out = append(out, Header{Name: h.name, Value: s})
	}
	return out, nil
}

func headerRefs(hs []header) []ref {
	var out []ref
	for _, h := range hs {
		out = append(out, h.tpl.refs()...)
	}
	return out
}
