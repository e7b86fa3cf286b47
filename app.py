"""MiniPaged Lab — `streamlit run app.py`."""


def main() -> None:
    from pathlib import Path

    import streamlit as st

    from app_pages._ui import PAGES, leave_settings_of_other_pages

    # A local file: a Material icon as the page icon made the browser fetch it from a font server
    st.set_page_config(page_title="MiniPaged Lab", page_icon=str(Path(__file__).parent / "static" / "favicon.png"),
                       layout="wide")
    pages = [st.Page(page.path, title=page.title, icon=page.icon, default=index == 0)
             for index, page in enumerate(PAGES)]
    page = st.navigation(pages)
    leave_settings_of_other_pages(page.url_path)
    page.run()


# Streamlit runs this script as __main__; the simulator's worker processes (multiprocessing) import it again as
# __mp_main__, where starting the app would cost each worker streamlit's import and a page run
if __name__ == "__main__":
    main()
